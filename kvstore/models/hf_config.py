"""Reading a Hugging Face model config in kvstore's terms: its KV layout and its RoPE parameters.

Accepts a transformers ``PretrainedConfig`` or the plain dict of a ``config.json``, written by transformers 4
(``rope_theta`` and ``rope_scaling`` at the top level) or 5 (both inside ``rope_parameters``). Only the RoPE schemes
a rotation can correct (default, linear, llama3; see ``kvstore.blend.rope``) are accepted; any other is refused here,
where the config enters, so no KV of such a model is ever re-rotated. The one exception is an MLA model (DeepSeek-V2/V3,
Kimi K2), which kvstore stores but never blends: its yarn RoPE is accepted as part of its layout's identity, and
``kvstore.blend.rope`` refuses to rotate it. A hybrid model whose layer types rotate differently (Gemma 3:
sliding-window layers at theta 1e4, full-attention layers at 1e6, each type's parameters in ``rope_parameters``) is
stored the same way, every type's parameters in the identity (``RopeScaling.PER_LAYER_TYPE``); blending refuses
sliding windows anyway. Nothing here imports transformers.

Pure functions; thread-safe.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvstore.errors import ConfigError
from kvstore.layout import KVDtype, KVLayout, RopeScaling, RopeSpec

__all__ = ["SUPPORTED_ROPE_TYPES", "layout_from_hf_config", "rope_spec_from_hf_config"]

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
"""``rope_type`` values whose K can be moved by one rotation."""

_DEFAULT_THETA = 10000.0
_YARN_TYPES = ("yarn", "deepseek_yarn")
"""yarn as a config names it, and as vLLM renames it in a DeepSeek model's config (the same parameters)."""


def _field(config: object, name: str) -> object:
    if isinstance(config, Mapping):
        return config.get(name)
    return getattr(config, name, None)


def _model_name(config: object) -> str:
    name = _field(config, "_name_or_path") or _field(config, "name_or_path") or _field(config, "model_type")
    return str(name) if name else "<unnamed model>"


def _number(value: object, key: str, rope_type: str, config: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(
            f"model {_model_name(config)}: {rope_type} rope parameters lack a numeric {key!r} (got {value!r}); "
            "fix the config's rope_parameters / rope_scaling"
        )
    return float(value)


def rope_spec_from_hf_config(config: object, *, stored_only: bool = False) -> RopeSpec:
    """The ``RopeSpec`` of a Hugging Face model config.

    Args:
        config: a ``PretrainedConfig`` or a ``config.json`` dict.
        stored_only: the model's KV is stored and never re-rotated (an MLA model, a sliding-window model: blending
            refuses both), so yarn (what DeepSeek-V2/V3 and Kimi K2 use) and per-layer-type parameters (Gemma 3) are
            accepted too, named with all their parameters in the identity.

    Raises:
        ConfigError: the model uses a RoPE scheme a rotation cannot correct (yarn, dynamic, longrope, ...), rotates
            only part of each head, or has per-layer RoPE parameters; or a needed parameter is missing.
    """
    parameters = _rope_parameters(config)
    if any(isinstance(value, Mapping) for value in parameters.values()):
        by_type = _used_layer_types(parameters, config)
        if len(by_type) == 1:  # every layer is of one type: that type's RoPE is the model's
            (only,) = by_type.values()
            return _single_spec(only, config, stored_only=stored_only)
        if not stored_only:
            raise ConfigError(
                f"model {_model_name(config)} has per-layer-type RoPE parameters ({sorted(parameters)}); kvstore "
                "re-rotates K of models with one RoPE scheme for every layer only"
            )
        return _per_layer_type_spec(by_type, config)
    return _single_spec(parameters, config, stored_only=stored_only)


def _rope_parameters(config: object) -> Mapping[str, object]:
    """The config's RoPE parameters: transformers 5's ``rope_parameters`` (flat, or one mapping per layer type), else
    transformers 4's ``rope_scaling``; a transformers 4 Gemma 3 config's ``rope_local_base_freq`` (its sliding
    layers' theta) is read as the per-layer-type form transformers 5 writes for it."""
    raw = _field(config, "rope_parameters")
    if raw is None:
        raw = _field(config, "rope_scaling")
    if raw is not None and not isinstance(raw, Mapping):
        raise ConfigError(f"model {_model_name(config)}: rope parameters {raw!r} are not a mapping")
    parameters: Mapping[str, object] = raw or {}
    local_theta = _field(config, "rope_local_base_freq")
    if local_theta is not None and not any(isinstance(value, Mapping) for value in parameters.values()):
        full = {"rope_theta": _field(config, "rope_theta"), **parameters}
        return {"full_attention": full, "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}}
    return parameters


def _used_layer_types(parameters: Mapping[str, object], config: object) -> dict[str, Mapping[str, object]]:
    """Per-layer-type parameters of the layer types the config's ``layer_types`` uses (all, when it names none)."""
    layer_types = _field(config, "layer_types")
    used = set(layer_types) if isinstance(layer_types, list | tuple) and layer_types else set(parameters)
    by_type: dict[str, Mapping[str, object]] = {}
    for layer_type in sorted(used):
        value = parameters.get(layer_type)
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"model {_model_name(config)}: its layers of type {layer_type!r} have no rope parameters "
                f"(rope_parameters names {sorted(parameters)})"
            )
        by_type[layer_type] = value
    return by_type


def _per_layer_type_spec(by_type: Mapping[str, Mapping[str, object]], config: object) -> RopeSpec:
    """One identity for several layer types' RoPE: every type's parameters in ``extra`` as
    ``{layer type}.{scheme}.{parameter}``; ``theta`` the full-attention layers' (what ``describe`` shows)."""
    extra: list[tuple[str, float]] = []
    specs = {layer_type: _single_spec(value, config, stored_only=True) for layer_type, value in by_type.items()}
    for layer_type, spec in specs.items():
        prefix = f"{layer_type}.{spec.scaling.value}."
        named = [("theta", spec.theta)]
        if spec.scaling is not RopeScaling.DEFAULT:
            named.append(("factor", spec.factor))
        if spec.scaling in (RopeScaling.LLAMA3, RopeScaling.YARN):
            named.append(("original_max_position_embeddings", float(spec.original_max_position_embeddings)))
        if spec.scaling is RopeScaling.LLAMA3:
            named += [("low_freq_factor", spec.low_freq_factor), ("high_freq_factor", spec.high_freq_factor)]
        extra += [(prefix + name, value) for name, value in [*named, *spec.extra]]
    main = specs.get("full_attention") or next(iter(specs.values()))
    return RopeSpec(theta=main.theta, scaling=RopeScaling.PER_LAYER_TYPE, extra=tuple(extra))


def _single_spec(parameters: Mapping[str, object], config: object, *, stored_only: bool) -> RopeSpec:
    """The ``RopeSpec`` of one RoPE scheme's parameters (the top-level ``rope_theta`` when they name none)."""
    rope_type = str(parameters.get("rope_type", parameters.get("type", "default")))
    theta = parameters.get("rope_theta", _field(config, "rope_theta"))
    partial = parameters.get("partial_rotary_factor", _field(config, "partial_rotary_factor"))
    if partial is not None and partial != 1.0:
        raise ConfigError(
            f"model {_model_name(config)} rotates only part of each head (partial_rotary_factor={partial}); "
            "kvstore re-rotates fully rotary heads only"
        )
    if stored_only and rope_type in _YARN_TYPES:
        return _yarn_spec(parameters, theta, config)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"refusing RoPE correction for model {_model_name(config)}: rope type {rope_type!r} cannot be moved "
            f"by one rotation (supported: {', '.join(SUPPORTED_ROPE_TYPES)}); blending is not available for it"
        )
    theta_value = _number(_DEFAULT_THETA if theta is None else theta, "rope_theta", rope_type, config)
    if rope_type == "default":
        return RopeSpec(theta=theta_value)
    factor = _number(parameters.get("factor"), "factor", rope_type, config)
    if rope_type == "linear":
        return RopeSpec(theta=theta_value, scaling=RopeScaling.LINEAR, factor=factor)
    original = parameters.get("original_max_position_embeddings") or _field(config, "max_position_embeddings")
    return RopeSpec(
        theta=theta_value,
        scaling=RopeScaling.LLAMA3,
        factor=factor,
        low_freq_factor=_number(parameters.get("low_freq_factor"), "low_freq_factor", rope_type, config),
        high_freq_factor=_number(parameters.get("high_freq_factor"), "high_freq_factor", rope_type, config),
        original_max_position_embeddings=int(_number(original, "original_max_position_embeddings", rope_type, config)),
    )


def _yarn_spec(parameters: Mapping[str, object], theta: object, config: object) -> RopeSpec:
    """Yarn's parameters as a ``RopeSpec`` (``extra``: every further number it names: beta_fast, beta_slow, mscale,
    mscale_all_dim, ...), so two yarn models of other parameters never share KV."""
    named = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings"}
    extra: list[tuple[str, float]] = []
    for name, value in parameters.items():
        if name in named or value is None:
            continue
        if not isinstance(value, int | float):  # bools are ints: stored as 0.0 / 1.0
            raise ConfigError(f"model {_model_name(config)}: yarn rope parameter {name}={value!r} is not a number")
        extra.append((name, float(value)))
    original = parameters.get("original_max_position_embeddings") or _field(config, "max_position_embeddings")
    return RopeSpec(
        theta=_number(_DEFAULT_THETA if theta is None else theta, "rope_theta", "yarn", config),
        scaling=RopeScaling.YARN,
        factor=_number(parameters.get("factor"), "factor", "yarn", config),
        original_max_position_embeddings=int(_number(original, "original_max_position_embeddings", "yarn", config)),
        extra=tuple(extra),
    )


def _positive_int(config: object, name: str) -> int | None:
    value = _field(config, name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"model {_model_name(config)}: {name}={value!r} must be a positive integer")
    return value


def _required_int(config: object, name: str) -> int:
    value = _positive_int(config, name)
    if value is None:
        raise ConfigError(
            f"model {_model_name(config)}: config has no {name}; is this a decoder-only transformer's config.json?"
        )
    return value


def layout_from_hf_config(
    config: object, *, model_id: str | None = None, dtype: KVDtype | str | torch.dtype | None = None
) -> KVLayout:
    """The ``KVLayout`` of a Hugging Face model config.

    A config with ``kv_lora_rank`` (DeepSeek-V2/V3, Kimi K2: multi-head latent attention) gives an MLA layout: one
    latent of ``kv_lora_rank + qk_rope_head_dim`` per token and layer (``KVLayout.for_mla``), what vLLM caches for it.

    Args:
        config: a ``PretrainedConfig`` or a ``config.json`` dict.
        model_id: the layout's model id; default the config's ``_name_or_path``.
        dtype: the KV cache dtype; default the config's ``dtype`` (``torch_dtype`` in transformers 4), else float32
            (what transformers loads a model in when the config names none).

    Raises:
        ConfigError: a shape field is missing or not a positive integer, the dtype is not a KV dtype, or the RoPE
            scheme is refused (``rope_spec_from_hf_config``; a sliding-window model's, like an MLA model's, is taken
            as stored only).
    """
    num_heads = _required_int(config, "num_attention_heads")
    head_dim = _positive_int(config, "head_dim") or _required_int(config, "hidden_size") // num_heads
    if dtype is None:
        config_dtype = _field(config, "dtype") or _field(config, "torch_dtype")
        dtype = config_dtype if isinstance(config_dtype, str | torch.dtype) else KVDtype.FLOAT32
    name = model_id or _field(config, "_name_or_path") or _field(config, "name_or_path")
    if not name:
        raise ConfigError("the model config carries no name; pass model_id, e.g. 'meta-llama/Llama-3.1-8B'")
    kv_lora_rank = _positive_int(config, "kv_lora_rank")
    if kv_lora_rank is not None:
        return KVLayout.for_mla(
            model_id=str(name),
            num_layers=_required_int(config, "num_hidden_layers"),
            kv_lora_rank=kv_lora_rank,
            rope_dim=_required_int(config, "qk_rope_head_dim"),
            dtype=KVDtype.parse(dtype),
            rope=rope_spec_from_hf_config(config, stored_only=True),  # MLA is never blended
        )
    return KVLayout(
        model_id=str(name),
        num_layers=_required_int(config, "num_hidden_layers"),
        num_kv_heads=_positive_int(config, "num_key_value_heads") or num_heads,
        head_dim=head_dim,
        dtype=KVDtype.parse(dtype),
        rope=rope_spec_from_hf_config(config, stored_only=_has_sliding_layers(config)),  # never blended either
    )


def _has_sliding_layers(config: object) -> bool:
    """Whether some layers attend a sliding window (what ``kvstore.blend`` refuses): ``layer_types`` names them, or a
    transformers 4 Gemma 3 config gives them a theta of their own."""
    layer_types = _field(config, "layer_types")
    named = isinstance(layer_types, list | tuple) and "sliding_attention" in layer_types
    return named or _field(config, "rope_local_base_freq") is not None
