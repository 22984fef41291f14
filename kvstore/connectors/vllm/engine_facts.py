"""What the connector needs to know about the vLLM engine it runs in, read from ``VllmConfig`` and checked at start.

- The vLLM version: the connector speaks the KV connector v1 API of vLLM 0.32, 0.33 and 0.34 (read from their
  sources: the per-layer ``[blocks, heads, slots, 2*head_dim]`` cache, worker metadata, ``has_sync_kv_loads``,
  ``get_transfer_results`` with ``failed_recving``, ``get_external_cache_hit_sources``). Another version fails at
  start with one line rather than misbehaving in the middle of a request. What 0.34 changed that the connector
  meets: a preempted request comes back among the step's new requests, with all its blocks (``resumed_req_ids`` is
  gone from the scheduler's output; the scheduler side reads it only where it exists); and the scheduler asks
  ``may_load_async`` (whether a request may load asynchronously, for ``--max-num-inflight-kv-loads``), which the
  connector leaves at vLLM's default (``KVStoreConnector`` says why). 0.34's other new hooks (sleep mode,
  ``kv_cache_access``, lookahead block hashes) keep their defaults.
- The model's KV layout (layers, kv heads, head dim, dtype, RoPE) as kvstore's ``KVLayout``: the store checks it
  against what it holds, so two models never share KV. An fp8 cache (``fp8``, ``fp8_e4m3``, ``fp8_e5m2``) is an fp8
  layout with the K and V scales each layer quantises with, from the checkpoint (per global KV head where its scales
  are per head: each head's rank's largest at the engine's tensor-parallel size), or vLLM's default 1.0
  (``checkpoint_scales``; the worker checks the layers' own); an MLA model (``use_mla``) is an MLA layout, one
  ``kv_lora_rank + qk_rope_head_dim`` latent a token (``kvstore.connectors.vllm.cache_shapes``).
- A string ``kvstore.chunk_separator`` as the engine tokenizer's ids (the store cuts chunks by ids).
- Tensor and pipeline parallelism are served: the layout is the whole model's (every layer, every KV head), whatever
  the engine's shape, and each rank stores and loads its part of it (``kvstore.connectors.vllm.parallel``).
- KV cache groups of full attention and sliding windows, one or several (vLLM's hybrid manager:
  ``kvstore.connectors.vllm.kv_groups``). What the connector does not handle yet: other kinds of group (chunked local
  attention, Mamba), and KV cache dtypes kvstore does not store (``check_engine_supported``). Each is refused at
  start with one line.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import vllm

from kvstore.connectors.settings import ConnectorSettings
from kvstore.connectors.vllm.checkpoint_scales import checkpoint_kv_scales
from kvstore.connectors.vllm.kv_groups import kv_groups_of
from kvstore.errors import ConfigError
from kvstore.layout import KVDtype, KVLayout
from kvstore.models.hf_config import layout_from_hf_config

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = [
    "SUPPORTED_VLLM",
    "check_engine_supported",
    "check_vllm_version",
    "engine_layout",
    "resolve_chunk_separator",
    "vllm_version",
]

logger = logging.getLogger(__name__)

SUPPORTED_VLLM = ((0, 32), (0, 33), (0, 34))
"""(major, minor) releases whose connector API this connector was written and tested against."""


def vllm_version() -> str:
    return str(getattr(vllm, "__version__", "unknown"))


def check_vllm_version(version: str) -> None:
    """Refuse, with one line, a vLLM release outside ``SUPPORTED_VLLM`` (its patch and local parts do not matter).

    Raises:
        ConfigError: ``version`` is another release, or not a version.
    """
    parts = version.split(".")
    try:
        major_minor = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        major_minor = (-1, -1)
    if major_minor not in SUPPORTED_VLLM:
        supported = ", ".join(f"{major}.{minor}" for major, minor in SUPPORTED_VLLM)
        raise ConfigError(f"kvstore's vLLM connector supports vLLM {supported}; this engine runs vLLM {version}")


def check_engine_supported(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> None:
    """Refuse, with one line, an engine the connector cannot serve correctly.

    Raises:
        ConfigError: an unsupported vLLM version, KV cache group or quantised KV cache.
    """
    check_vllm_version(vllm_version())
    if kv_cache_config is not None:  # full-attention and sliding-window groups (``kv_groups``)
        kv_groups_of(kv_cache_config, vllm_config.cache_config.block_size)
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype != "auto" and not _is_kv_dtype(cache_dtype):  # fp8 is stored as the engine's bytes
        raise ConfigError(
            "kvstore stores float16, bfloat16, float32 or fp8 (fp8, fp8_e4m3, fp8_e5m2) KV; this engine's "
            f"kv_cache_dtype is {cache_dtype}"
        )


def _is_kv_dtype(cache_dtype: str) -> bool:
    """Whether vLLM's ``kv_cache_dtype`` is one kvstore stores (not e.g. ``fp8_ds_mla``, with its per-block scales)."""
    try:
        KVDtype.parse(cache_dtype)
    except ConfigError:
        return False
    return True


def engine_layout(vllm_config: VllmConfig, settings: ConnectorSettings) -> KVLayout:
    """The engine model's ``KVLayout``, named ``settings.model_id`` or the served model name.

    Raises:
        ConfigError: the model's config lacks a shape field or uses a RoPE scheme kvstore refuses.
    """
    model_config = vllm_config.model_config
    served = model_config.served_model_name
    name = settings.model_id or (served[0] if isinstance(served, list) else served) or model_config.model
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    dtype = model_config.dtype if cache_dtype == "auto" else cache_dtype
    layout = layout_from_hf_config(model_config.hf_config, model_id=str(name), dtype=dtype)
    # the whole model's, on every rank of a tensor- or pipeline-parallel engine: stored KV never names a rank
    parallel = vllm_config.parallel_config
    num_layers = model_config.get_total_num_hidden_layers()
    num_kv_heads = (
        model_config.get_num_kv_heads(parallel) if model_config.use_mla else model_config.get_total_num_kv_heads()
    )
    head_dim = model_config.get_head_size()
    if (layout.num_layers, layout.num_kv_heads, layout.head_dim) != (num_layers, num_kv_heads, head_dim):
        raise ConfigError(
            f"model {name}: its config says {layout.num_layers} layers x {layout.num_kv_heads} kv heads x "
            f"{layout.head_dim}, vLLM runs {num_layers} x {num_kv_heads} x {head_dim}"
        )
    if layout.dtype.is_quantized and layout.mla is None:  # the scales the checkpoint gives the layers, or 1.0
        layout = dataclasses.replace(layout, kv_scales=checkpoint_kv_scales(vllm_config, layout.num_layers))
    return layout


def resolve_chunk_separator(vllm_config: VllmConfig, settings: ConnectorSettings) -> ConnectorSettings:
    """``settings`` with a string ``kvstore.chunk_separator`` turned into the engine tokenizer's ids for it.

    Tokenized alone, without special tokens: a prompt must carry these exact ids (a client that builds prompts from
    separately tokenized parts does; text tokenized as a whole may merge the separator with its neighbours).

    Raises:
        ConfigError: the tokenizer cannot be loaded or gives no ids for the string.
    """
    separator = settings.embedded.chunk_separator
    if not isinstance(separator, str):
        return settings
    from transformers import AutoTokenizer

    model_config = vllm_config.model_config
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            model_config.tokenizer,
            revision=model_config.tokenizer_revision,
            trust_remote_code=model_config.trust_remote_code,
        )
        ids = tuple(int(token) for token in tokenizer.encode(separator, add_special_tokens=False))
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"kvstore.chunk_separator: cannot tokenize {separator!r} with {model_config.tokenizer}: {exc}"
        ) from None
    if not ids:
        raise ConfigError(f"kvstore.chunk_separator {separator!r} is no tokens for {model_config.tokenizer}")
    logger.info("kvstore.chunk_separator %r is token ids %s", separator, list(ids))
    return dataclasses.replace(settings, embedded=dataclasses.replace(settings.embedded, chunk_separator=ids))
