"""Find the model a vLLM worker loaded, from the connector's side, without patching vLLM.

vLLM hands a KV connector its config and KV caches, never the model. But every attention layer registers itself in
the config's ``static_forward_context`` under its module path (``model.layers.0.self_attn.attn``), and vLLM 0.32
builds the worker's connector after ``load_model``. So the model is the one live ``nn.Module`` whose
``get_submodule(path)`` is each of those attention objects: found once by identity, at ``register_kv_caches``.

The checks after it refuse, each with one line, what the layerwise pass cannot run exactly: a model outside the
Llama family (``BLENDABLE_ARCHITECTURES``), pipeline stages, sliding windows, RoPE that is not NeoX-style over the
whole head, quantised weights, LoRA and speculative decoding.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Mapping
from typing import Any

import torch

from kvstore.errors import ConfigError

__all__ = ["BLENDABLE_ARCHITECTURES", "find_loaded_model"]

logger = logging.getLogger(__name__)

BLENDABLE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
"""vLLM model classes whose decoder layers ``VllmLlamaStack`` runs (the same decoder; Qwen2 adds q/k/v biases)."""


def find_loaded_model(vllm_config: Any, attention_layers: Mapping[str, torch.nn.Module]) -> torch.nn.Module:
    """The worker's model: the module whose submodules at the attention layers' names are those layers.

    Raises:
        ConfigError: no such module, more than one, or one the layerwise pass cannot run.
    """
    _refuse_engine_features(vllm_config)
    if not attention_layers:
        raise ConfigError("kvstore.blend: the engine registered no attention layers")
    names = list(attention_layers)
    found = []
    for candidate in gc.get_objects():
        if type(candidate).__name__ not in BLENDABLE_ARCHITECTURES or not isinstance(candidate, torch.nn.Module):
            continue
        if all(_submodule(candidate, name) is attention_layers[name] for name in names):
            found.append(candidate)
    architectures = getattr(vllm_config.model_config, "architectures", None) or ()
    if not found:
        raise ConfigError(
            f"kvstore.blend runs {', '.join(BLENDABLE_ARCHITECTURES)} models; this engine runs "
            f"{', '.join(architectures) or 'another model'} (or vLLM built the connector before the model)"
        )
    if len(found) > 1:
        raise ConfigError(f"kvstore.blend found {len(found)} models owning the engine's attention layers; run one")
    model = found[0]
    _refuse_model_features(model)
    logger.info("kvstore.blend: blending on %s (%d layers)", type(model).__name__, len(names))
    return model


def _submodule(model: torch.nn.Module, name: str) -> torch.nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _refuse_engine_features(vllm_config: Any) -> None:
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise ConfigError("kvstore.blend does not run with speculative decoding (a second model shares the steps)")
    if getattr(vllm_config, "lora_config", None) is not None:
        raise ConfigError("kvstore.blend does not run with LoRA adapters (their layers depend on the batch)")
    quantization = getattr(vllm_config.model_config, "quantization", None)
    if quantization is not None:
        raise ConfigError(f"kvstore.blend runs unquantised weights; this model is quantised with {quantization}")


def _refuse_model_features(model: torch.nn.Module) -> None:
    decoder = getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if decoder is None or layers is None:
        raise ConfigError(f"kvstore.blend: {type(model).__name__} has no model.layers")
    if getattr(decoder, "start_layer", 0) != 0 or getattr(decoder, "end_layer", len(layers)) != len(layers):
        raise ConfigError("kvstore.blend needs every layer in one worker (no pipeline parallelism)")
    config = getattr(model, "config", None)
    layer_types = getattr(config, "layer_types", None) or ()
    if "sliding_attention" in layer_types or getattr(config, "use_sliding_window", False):
        raise ConfigError("kvstore.blend does not run sliding-window attention (the pass attends the whole prompt)")
    for index, layer in enumerate(layers):
        attention: Any = getattr(layer, "self_attn", None)
        for name in ("qkv_proj", "o_proj", "rotary_emb", "attn"):
            if getattr(attention, name, None) is None:
                raise ConfigError(f"kvstore.blend: layer {index} lacks self_attn.{name}; not a Llama-family layer")
        for name in ("q_norm", "k_norm"):
            if getattr(attention, name, None) is not None:
                raise ConfigError("kvstore.blend does not run models that normalise q/k per head (qk_norm)")
        rotary = attention.rotary_emb
        if not getattr(rotary, "is_neox_style", False) or getattr(rotary, "rotary_dim", None) != attention.head_dim:
            raise ConfigError(
                "kvstore.blend re-rotates NeoX-style RoPE over the whole head; this model's rotary embedding is "
                f"{type(rotary).__name__}(rotary_dim={getattr(rotary, 'rotary_dim', None)}, "
                f"neox={getattr(rotary, 'is_neox_style', None)}, head_dim={attention.head_dim})"
            )
