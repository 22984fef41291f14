"""The layout of an fp8 KV cache and of an MLA latent: their identity (namespace), JSON and description, and that every
earlier layout keeps the namespace it had (data dirs on disk keep their keys). fp8 scales per layer, or per layer and
KV head (what a per-head checkpoint's heads are quantised with), folded so that one quantisation is one identity."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import ConfigError, InvalidInputError
from kvstore.kv_part import KVPart
from kvstore.layout import KVDtype, KVLayout, KVScales, MLASpec, RopeScaling, RopeSpec
from kvstore.models.hf_config import layout_from_hf_config

FP8 = KVLayout(model_id="test/fp8", num_layers=4, num_kv_heads=2, head_dim=64, dtype="fp8")
MLA = KVLayout.for_mla(model_id="test/mla", num_layers=3, kv_lora_rank=512, rope_dim=64)

scales = st.floats(min_value=1e-6, max_value=1e3, allow_nan=False, allow_infinity=False)
float_dtypes = st.sampled_from([KVDtype.FLOAT16, KVDtype.BFLOAT16, KVDtype.FLOAT32])
fp8_dtypes = st.sampled_from([KVDtype.FLOAT8_E4M3, KVDtype.FLOAT8_E5M2])


def v1_namespace(layout: KVLayout) -> bytes:
    """The namespace as kvstore computed it before fp8 and MLA existed (kvstore-layout-v1), written out here."""
    text = "|".join(
        [
            "kvstore-layout-v1",
            layout.model_id,
            str(layout.num_layers),
            str(layout.num_kv_heads),
            str(layout.head_dim),
            layout.dtype.value,
            layout.rope.canonical(),
        ]
    )
    return xxhash.xxh3_128_digest(text.encode("utf-8"))


@settings(max_examples=60, deadline=None)
@given(
    model_id=st.text(min_size=1, max_size=20),
    num_layers=st.integers(1, 96),
    num_kv_heads=st.integers(1, 64),
    head_dim=st.integers(1, 512),
    dtype=float_dtypes,
    theta=st.floats(min_value=1.0, max_value=1e7),
)
def test_float_layouts_keep_their_namespace(
    model_id: str, num_layers: int, num_kv_heads: int, head_dim: int, dtype: KVDtype, theta: float
) -> None:
    layout = KVLayout(
        model_id=model_id,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        rope=RopeSpec(theta=theta),
    )
    assert layout.namespace == v1_namespace(layout)
    assert "kv_scales" not in json.loads(layout.to_json()) and "mla" not in json.loads(layout.to_json())


def test_fp8_never_shares_a_namespace_with_float_kv_of_the_same_model() -> None:
    namespaces = {dataclasses.replace(FP8, dtype=dtype, kv_scales=None).namespace for dtype in KVDtype}
    assert len(namespaces) == len(KVDtype)


@settings(max_examples=60, deadline=None)
@given(dtype=fp8_dtypes, k=st.lists(scales, min_size=1, max_size=4), v=st.lists(scales, min_size=1, max_size=4))
def test_fp8_scales_are_part_of_the_identity(dtype: KVDtype, k: list[float], v: list[float]) -> None:
    v = (v * 4)[: len(k)]
    per_layer = KVScales(k=tuple((k * 4)[:4]), v=tuple((v * 4)[:4])) if len(k) > 1 else KVScales(k=(k[0],), v=(v[0],))
    layout = dataclasses.replace(FP8, dtype=dtype, kv_scales=per_layer)
    unit = dataclasses.replace(FP8, dtype=dtype, kv_scales=None)
    assert (layout.namespace == unit.namespace) == (layout.kv_scales == unit.kv_scales)
    assert KVLayout.from_json(layout.to_json()) == layout
    assert KVLayout.from_json(layout.to_json()).namespace == layout.namespace


def test_a_scale_one_ulp_apart_is_another_layout() -> None:
    near = torch.nextafter(torch.tensor(1.0, dtype=torch.float64), torch.tensor(2.0, dtype=torch.float64)).item()
    assert dataclasses.replace(FP8, kv_scales=KVScales(k=(near,), v=(1.0,))).namespace != FP8.namespace


def test_vllm_fp8_names_parse_to_the_format_they_store() -> None:
    assert KVDtype.parse("fp8") is KVDtype.parse("fp8_e4m3") is KVDtype.FLOAT8_E4M3
    assert KVDtype.parse("fp8_e5m2") is KVDtype.FLOAT8_E5M2
    assert KVDtype.parse(torch.float8_e4m3fn) is KVDtype.FLOAT8_E4M3
    for dtype in (KVDtype.FLOAT8_E4M3, KVDtype.FLOAT8_E5M2):
        assert dtype.is_quantized and dtype.torch_dtype == torch.uint8 and dtype.element_size_bytes == 1
    assert KVDtype.FLOAT8_E4M3.storage_dtype == torch.float8_e4m3fn
    assert KVDtype.FLOAT8_E5M2.storage_dtype == torch.float8_e5m2
    assert not KVDtype.BFLOAT16.is_quantized and KVDtype.BFLOAT16.storage_dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="fp8_ds_mla"):
        KVDtype.parse("fp8_ds_mla")


def test_an_fp8_layout_defaults_to_unit_scales_and_describes_them() -> None:
    assert FP8.kv_scales == KVScales(k=(1.0,), v=(1.0,))
    assert FP8.bytes_per_token == 4 * 2 * 2 * 64
    assert "float8_e4m3 scales k=1 v=1" in FP8.describe()
    assert KVScales.of_layers([0.5, 0.5], [2.0, 2.0]) == KVScales(k=(0.5,), v=(2.0,))
    assert KVScales.of_layers([0.5, 0.25], [2.0, 2.0]).layer(1) == (0.25, 2.0)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"dtype": "bfloat16", "kv_scales": KVScales()}, "fp8 KV only"),
        ({"kv_scales": KVScales(k=(1.0, 1.0), v=(1.0, 1.0))}, "2 layers; the layout has 4"),
    ],
)
def test_bad_scales_are_one_line(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(FP8, **changes)  # type: ignore[arg-type]


PER_HEAD = KVScales.of_heads(
    [(0.5, 0.5), (0.25, 0.125), (1.0, 1.0), (2.0, 2.0)], [(1.0, 1.0), (1.0, 1.0), (1.0, 3.0), (1.0, 1.0)]
)
"""Four layers x two KV heads; layers 1 (K) and 2 (V) have heads of different scales."""


def test_per_head_scales_are_layer_major_and_fold_where_a_layers_heads_agree() -> None:
    assert PER_HEAD.per_head and PER_HEAD.heads == 2 and PER_HEAD.num_layers == 4
    assert PER_HEAD.k == (0.5, 0.5, 0.25, 0.125, 1.0, 1.0, 2.0, 2.0)
    assert PER_HEAD.layer_heads(1) == ((0.25, 0.125), (1.0, 1.0)) and PER_HEAD.layer(0) == (0.5, 1.0)
    with pytest.raises(ValueError, match="layer 1's heads have different kv scales"):
        PER_HEAD.layer(1)
    agreeing = KVScales.of_heads([(0.5, 0.5), (0.25, 0.25)], [(1.0, 1.0), (2.0, 2.0)])
    assert agreeing == KVScales.of_layers([0.5, 0.25], [1.0, 2.0]) and not agreeing.per_head
    assert KVScales.of_heads([(0.5, 0.5)] * 3, [(1.0, 1.0)] * 3) == KVScales(k=(0.5,), v=(1.0,))
    assert PER_HEAD.describe() == "per-head scales (4 layers x 2 kv heads)"


def test_per_head_scales_are_their_own_identity_and_travel_in_json() -> None:
    from kvstore.wire.messages import layout_from_json

    layout = dataclasses.replace(FP8, kv_scales=PER_HEAD)
    as_per_layer = dataclasses.replace(FP8, kv_scales=KVScales(k=PER_HEAD.k[::2], v=PER_HEAD.v[::2]))  # head 0's
    assert len({layout.namespace, as_per_layer.namespace, FP8.namespace}) == 3
    assert json.loads(layout.to_json())["kv_scales"]["heads"] == 2
    assert "heads" not in json.loads(as_per_layer.to_json())["kv_scales"]  # earlier layouts' JSON is unchanged
    assert KVLayout.from_json(layout.to_json()) == layout == layout_from_json(layout.to_json())
    assert KVLayout.from_json(layout.to_json()).namespace == layout.namespace
    assert "per-head scales (4 layers x 2 kv heads)" in layout.describe()


def test_a_part_keeps_its_layers_and_heads_scales() -> None:
    layout = dataclasses.replace(FP8, kv_scales=PER_HEAD)
    rank0 = KVPart(layer_start=0, layer_end=4, head_start=0, head_end=1).shape_layout(layout)
    assert rank0.kv_scales == KVScales(k=(0.5, 0.25, 1.0, 2.0), v=(1.0, 1.0, 1.0, 1.0))  # one head: per layer
    rank1 = KVPart(layer_start=0, layer_end=4, head_start=1, head_end=2).shape_layout(layout)
    assert rank1.kv_scales == KVScales(k=(0.5, 0.125, 1.0, 2.0), v=(1.0, 1.0, 3.0, 1.0))
    stage = KVPart(layer_start=1, layer_end=3, head_start=0, head_end=2).shape_layout(layout)
    assert stage.kv_scales == KVScales(k=(0.25, 0.125, 1.0, 1.0), v=(1.0, 1.0, 1.0, 3.0), heads=2)
    last = KVPart(layer_start=3, layer_end=4, head_start=0, head_end=2).shape_layout(layout)
    assert last.kv_scales == KVScales(k=(2.0,), v=(1.0,))


@pytest.mark.parametrize(
    ("scales", "message"),
    [
        (KVScales(k=(1.0,) * 6, v=(1.0,) * 6, heads=2), "name 3 layers; the layout has 4"),
        (KVScales(k=(1.0,) * 12, v=(1.0,) * 12, heads=3), "name 3 kv heads; the layout has 2"),
    ],
)
def test_per_head_scales_of_another_shape_are_one_line(scales: KVScales, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(FP8, kv_scales=scales)
    with pytest.raises(ConfigError, match="a scale for each of 2 heads of every layer; got 3"):
        KVScales(k=(1.0,) * 3, v=(1.0,) * 3, heads=2)


def test_a_server_refuses_per_head_scales_whose_heads_are_not_a_number() -> None:
    from kvstore.wire.error_codes import RequestError
    from kvstore.wire.messages import layout_from_json

    bad = json.loads(dataclasses.replace(FP8, kv_scales=PER_HEAD).to_json())
    bad["kv_scales"]["heads"] = "2"
    with pytest.raises(RequestError, match="'heads' must be an int"):
        layout_from_json(json.dumps(bad))


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_a_scale_must_be_positive_and_finite(bad: float) -> None:
    with pytest.raises(ConfigError, match="positive finite"):
        KVScales(k=(bad,), v=(1.0,))


def test_fp8_kv_travels_as_bytes() -> None:
    FP8.check_kv(torch.zeros(FP8.chunk_shape(3), dtype=torch.uint8), 3)
    with pytest.raises(InvalidInputError, match=r"torch\.uint8"):
        FP8.check_kv(torch.zeros(FP8.chunk_shape(3), dtype=torch.float8_e4m3fn), 3)


def test_an_mla_layout_is_one_latent_plane() -> None:
    assert MLA.mla == MLASpec(kv_lora_rank=512, rope_dim=64)
    assert (MLA.num_kv_heads, MLA.head_dim, MLA.num_planes) == (1, 576, 1)
    assert MLA.chunk_shape(5) == (3, 1, 5, 1, 576)
    assert MLA.bytes_per_token == 3 * 576 * 2
    assert "3 layers x MLA latent 576 = 512 compressed + 64 rope" in MLA.describe()
    plain = KVLayout(model_id="test/mla", num_layers=3, num_kv_heads=1, head_dim=576)
    assert plain.namespace != MLA.namespace and plain.chunk_shape(5) == (3, 2, 5, 1, 576)
    other_split = KVLayout.for_mla(model_id="test/mla", num_layers=3, kv_lora_rank=448, rope_dim=128)
    assert other_split.namespace != MLA.namespace
    assert KVLayout.from_json(MLA.to_json()) == MLA
    with pytest.raises(InvalidInputError, match=r"\[num_layers, 1, num_tokens, 1, latent\]"):
        MLA.check_kv(torch.zeros((3, 2, 5, 1, 576), dtype=torch.bfloat16), 5)


def test_an_mla_layout_with_heads_is_refused() -> None:
    with pytest.raises(ConfigError, match="one 576-wide latent"):
        dataclasses.replace(MLA, num_kv_heads=2)
    with pytest.raises(ConfigError, match="kv_lora_rank=0"):
        MLASpec(kv_lora_rank=0, rope_dim=64)


def test_a_deepseek_v2_config_gives_an_mla_layout() -> None:
    config = {
        "_name_or_path": "deepseek-ai/DeepSeek-V2-Lite",
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "hidden_size": 2048,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "rope_theta": 10000,
        "dtype": "bfloat16",
    }
    layout = layout_from_hf_config(config)
    assert layout == KVLayout.for_mla(
        model_id="deepseek-ai/DeepSeek-V2-Lite", num_layers=27, kv_lora_rank=512, rope_dim=64, dtype="bfloat16"
    )
    assert layout.rope.scaling is RopeScaling.DEFAULT


def test_a_server_reads_fp8_and_mla_layouts_off_the_wire() -> None:
    from kvstore.wire.error_codes import RequestError
    from kvstore.wire.messages import layout_from_json

    calibrated = dataclasses.replace(FP8, kv_scales=KVScales(k=(0.5, 0.25, 1.0, 2.0), v=(1.0, 1.0, 1.0, 1.0)))
    for layout in (FP8, calibrated, MLA):
        assert layout_from_json(layout.to_json()) == layout
    bad = json.loads(FP8.to_json()) | {"kv_scales": {"k": ["1"], "v": [1.0]}}
    with pytest.raises(RequestError, match=r"kv_scales\.k"):
        layout_from_json(json.dumps(bad))


DEEPSEEK_V3_ROPE = {
    "type": "yarn",
    "factor": 40,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def deepseek_config(rope_scaling: dict[str, object] | None) -> dict[str, object]:
    return {
        "_name_or_path": "deepseek-ai/DeepSeek-V3",
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "hidden_size": 7168,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "rope_theta": 10000,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": 163840,
        "dtype": "bfloat16",
    }


def test_an_mla_model_with_yarn_rope_is_named_by_all_its_parameters() -> None:
    from kvstore.blend.rope import RopeRotator
    from kvstore.wire.messages import layout_from_json

    layout = layout_from_hf_config(deepseek_config(DEEPSEEK_V3_ROPE))
    rope = layout.rope
    assert layout.mla is not None and rope.scaling is RopeScaling.YARN
    assert (rope.factor, rope.original_max_position_embeddings) == (40.0, 4096)
    assert dict(rope.extra) == {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    assert "rope yarn" in layout.describe()
    assert KVLayout.from_json(layout.to_json()) == layout == layout_from_json(layout.to_json())
    other_mscale = layout_from_hf_config(deepseek_config(DEEPSEEK_V3_ROPE | {"mscale": 0.707}))
    assert other_mscale.namespace != layout.namespace
    assert layout_from_hf_config(deepseek_config(None)).namespace != layout.namespace
    with pytest.raises(ConfigError, match="no rotation"):
        RopeRotator(rope, 64)  # stored, never re-rotated


def test_yarn_is_still_refused_for_a_model_kvstore_would_blend() -> None:
    config = deepseek_config(DEEPSEEK_V3_ROPE)
    for key in ("kv_lora_rank", "qk_rope_head_dim"):
        config.pop(key)
    with pytest.raises(ConfigError, match="rope type 'yarn'"):
        layout_from_hf_config(config)


def test_vllms_deepseek_yarn_is_the_same_identity_as_the_configs_yarn() -> None:
    renamed = DEEPSEEK_V3_ROPE | {"rope_type": "deepseek_yarn"}  # what vLLM's config holds for a DeepSeek model
    assert layout_from_hf_config(deepseek_config(renamed)) == layout_from_hf_config(deepseek_config(DEEPSEEK_V3_ROPE))
