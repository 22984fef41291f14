"""The forward pass of a Llama-family Hugging Face model, one decoder layer at a time, on any subset of a prompt.

A blended prefill computes different tokens in different layers (all of them up to the check layer, a selection
after it) and attends over a KV cache that is partly fresh and partly loaded, so it cannot call the model's own
``forward``. ``LlamaStack`` runs the model's own modules (embedding, RMSNorms, q/k/v/o projections, MLP, rotary
embedding, final norm, LM head) and does only the attention itself, with the same arithmetic transformers 5 uses
(``modeling_llama``: RoPE as ``x * cos + rotate_half(x) * sin`` in the model dtype, scale ``head_dim ** -0.5``,
``num_key_value_groups`` query heads per KV head, softmax attention through ``scaled_dot_product_attention``)::

    hidden [1, n, hidden] --input_layernorm--> q/k/v_proj --RoPE at the tokens' positions--> q [1, H, n, D]
                                                                                           k, v [1, Hkv, n, D]
    (the caller writes k, v into the layer's KV [T, Hkv, D] at the tokens' positions)
    attention(q, layer KV [T tokens], token i sees keys at positions <= its own) --o_proj--> + hidden
    --post_attention_layernorm--> MLP --> + hidden

When the queries are the whole prompt in order the attention is plain causal (``is_causal``, grouped-query heads
handled by sdpa, exactly what transformers does); otherwise ``QueryMask`` (``query_attention``) attends a subset of
the tokens causally by absolute position.

Models: ``model_type`` llama, mistral and qwen2 (the same decoder; qwen2's q/k/v biases live in its projections).
Refused: other types, sliding-window attention, and models whose modules are not where Llama keeps them.

Not thread-safe (torch modules are not); callers run it under ``torch.inference_mode``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import cast

import torch

from kvstore.blend.query_attention import QueryMask
from kvstore.errors import ConfigError

__all__ = ["SUPPORTED_MODEL_TYPES", "LlamaStack", "Projection", "RotaryTable"]

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
"""``config.model_type`` values whose decoder layers ``LlamaStack`` can run."""

_LAYER_MODULES = ("self_attn", "input_layernorm", "post_attention_layernorm", "mlp")
_ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True, slots=True, kw_only=True)
class RotaryTable:
    """cos/sin of the rotary embedding at a set of positions, ``[1, 1, n, head_dim]`` in the model dtype."""

    cos: torch.Tensor
    sin: torch.Tensor


@dataclass(frozen=True, slots=True, kw_only=True)
class Projection:
    """One layer's fresh q/k/v of ``n`` tokens, RoPE applied: q ``[1, H, n, D]``, k and v ``[1, Hkv, n, D]``."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor

    def token_major_key(self) -> torch.Tensor:
        """k as ``[n, Hkv, D]``, the KV layout's token-major order (a view)."""
        return self.key[0].transpose(0, 1)

    def token_major_value(self) -> torch.Tensor:
        return self.value[0].transpose(0, 1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaStack:
    """A Llama-family causal LM seen as embedding -> decoder layers -> norm -> LM head.

    Args:
        model: a transformers ``LlamaForCausalLM`` (or Mistral / Qwen2) in eval mode.

    Raises:
        ConfigError: the model is not one ``LlamaStack`` can run (type, sliding window, module structure).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        config = getattr(model, "config", None)
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"refusing to blend a {model_type or type(model).__name__!r} model: the layerwise blender runs "
                f"Llama-family causal LMs ({', '.join(SUPPORTED_MODEL_TYPES)}); load one of those"
            )
        layer_types = getattr(config, "layer_types", None) or ()
        sliding = "sliding_attention" in layer_types or (
            model_type == "mistral" and getattr(config, "sliding_window", None) is not None
        )
        if sliding:
            raise ConfigError(
                f"refusing to blend this {model_type} model: it uses sliding-window attention "
                f"(sliding_window={getattr(config, 'sliding_window', None)}), which the blender's full-prompt "
                "attention does not implement; use a config with sliding_window=None"
            )
        decoder = getattr(model, "model", None)
        layers = getattr(decoder, "layers", None)
        missing = [
            name
            for name, owner in (("model.embed_tokens", decoder), ("model.norm", decoder),
                                ("model.rotary_emb", decoder), ("lm_head", model))
            if getattr(owner, name.rsplit(".", 1)[-1], None) is None
        ]  # fmt: skip
        if layers is None or not len(layers):
            missing.append("model.layers")
        else:
            for index, layer in enumerate(layers):
                missing += [f"model.layers.{index}.{name}" for name in _LAYER_MODULES if not hasattr(layer, name)]
                attention = getattr(layer, "self_attn", None)
                missing += [
                    f"model.layers.{index}.self_attn.{name}" for name in _ATTENTION_MODULES
                    if not hasattr(attention, name)
                ]  # fmt: skip
        if missing:
            raise ConfigError(
                f"refusing to blend this {model_type} model: it lacks the Llama modules {', '.join(missing[:4])}; "
                "pass a transformers LlamaForCausalLM, MistralForCausalLM or Qwen2ForCausalLM"
            )
        assert decoder is not None and layers is not None
        self.model = model
        self._decoder = decoder
        self._layers = list(layers)
        parameter = next(model.parameters())
        self.device = parameter.device
        self.dtype = parameter.dtype
        attention = self._layers[0].self_attn
        self.head_dim = int(attention.head_dim)
        self.scaling = float(attention.scaling)
        self.num_heads = int(config.num_attention_heads)  # type: ignore[union-attr]
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.num_key_value_groups = self.num_heads // self.num_kv_heads

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[1, n, hidden]`` of ``token_ids`` ``[n]`` (int64 on the model device)."""
        return cast(torch.Tensor, self._decoder.embed_tokens(token_ids[None, :]))

    def rotary(self, hidden: torch.Tensor, positions: torch.Tensor) -> RotaryTable:
        """cos/sin at ``positions`` from the model's own rotary embedding (its ``inv_freq``, its dtype rules)."""
        cos, sin = self._decoder.rotary_emb(hidden, positions[None, :])
        return RotaryTable(cos=cos[:, None], sin=sin[:, None])

    def project(self, layer_idx: int, hidden: torch.Tensor, rotary: RotaryTable) -> Projection:
        """Fresh q/k/v of a layer for the tokens of ``hidden`` ``[1, n, hidden]``, RoPE applied."""
        layer = self._layers[layer_idx]
        attention = layer.self_attn
        normed = layer.input_layernorm(hidden)
        shape = (1, normed.shape[1], -1, self.head_dim)
        query = attention.q_proj(normed).view(shape).transpose(1, 2)
        key = attention.k_proj(normed).view(shape).transpose(1, 2)
        value = attention.v_proj(normed).view(shape).transpose(1, 2)
        query = (query * rotary.cos) + (_rotate_half(query) * rotary.sin)
        key = (key * rotary.cos) + (_rotate_half(key) * rotary.sin)
        return Projection(query=query, key=key, value=value)

    def attend_and_finish(
        self,
        layer_idx: int,
        hidden: torch.Tensor,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: QueryMask,
    ) -> torch.Tensor:
        """The rest of the layer: attention of ``query`` over the layer's KV, o_proj, residual, MLP, residual.

        Args:
            layer_idx: the decoder layer.
            hidden: the layer's input hidden states ``[1, n, hidden]`` (the residual).
            query: ``[1, H, n, D]`` from ``project``.
            keys: the layer's K of the whole prompt ``[T, Hkv, D]`` (fresh and cached), in the model dtype.
            values: its V, the same shape.
            mask: which keys each query sees.

        Returns:
            The layer's output hidden states ``[1, n, hidden]``.
        """
        layer = self._layers[layer_idx]
        attended = mask.attend(
            query, keys.permute(1, 0, 2)[None], values.permute(1, 0, 2)[None],
            scale=self.scaling, kv_groups=self.num_key_value_groups,
        )  # fmt: skip
        attended = attended.transpose(1, 2).reshape(1, hidden.shape[1], -1)
        hidden = hidden + layer.self_attn.o_proj(attended)
        return cast(torch.Tensor, hidden + layer.mlp(layer.post_attention_layernorm(hidden)))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[vocab]`` of the last token of ``hidden`` ``[1, n, hidden]``."""
        last = self._decoder.norm(hidden[:, -1:])
        head = cast(torch.nn.Module, self.model.lm_head)
        return cast(torch.Tensor, head(last))[0, -1].float()
