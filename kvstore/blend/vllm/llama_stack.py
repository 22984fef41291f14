"""``VllmLlamaStack``: the decoder layers of a Llama-family model vLLM loaded, run one layer at a time on any tokens.

The layerwise pass (``kvstore.blend.layerwise``) computes different tokens in different layers over KV that is
partly cached, so it cannot call vLLM's ``LlamaModel.forward`` (its ``Attention`` reads and writes the step's paged
cache through vLLM's forward context). It calls the layer's own modules as plain torch modules instead, and only the
attention is kvstore's (``QueryMask``, the same as for Hugging Face models)::

    hidden [n, hidden] --input_layernorm--> qkv_proj --split--> q [n, H*D], k, v [n, Hkv*D]
    --rotary_emb(positions, q, k)--> (vLLM's own RoPE kernel, in place) --> attention --o_proj--> + hidden
    --post_attention_layernorm--> mlp --> + hidden

Two of vLLM's conventions are avoided on purpose: the norms are called without the fused residual (``norm(x,
residual)`` updates its arguments in place), and the residual is added here; ``rotary_emb`` rotates its inputs in
place, so it gets copies.

Not thread-safe; runs under ``torch.inference_mode`` on the worker's thread.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from kvstore.blend.llama_layers import Projection
from kvstore.blend.query_attention import QueryMask

__all__ = ["VllmLlamaStack"]


class VllmLlamaStack:
    """A vLLM ``LlamaForCausalLM`` (or Mistral / Qwen2) as a ``LayerStack`` (checked by ``find_loaded_model``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        decoder: Any = model.model  # vLLM's modules, duck-typed (checked by ``find_loaded_model``)
        self._decoder = decoder
        self._layers: list[Any] = list(decoder.layers)
        attention = self._layers[0].self_attn
        parameter = next(model.parameters())
        self.device = parameter.device
        self.dtype = parameter.dtype
        self.head_dim = int(attention.head_dim)
        self.num_heads = int(attention.num_heads)
        self.num_kv_heads = int(attention.num_kv_heads)
        self.scaling = float(attention.scaling)
        self._q_size = int(attention.q_size)
        self._kv_size = int(attention.kv_size)

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self._decoder.embed_tokens(token_ids))[None]

    def rotary(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """vLLM's rotary op takes the absolute positions (int64) and computes the angles itself."""
        return positions.to(torch.int64)

    def rotate_keys(self, layer_idx: int, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``keys`` ``[n, Hkv*D]`` rotated to ``positions`` by the layer's own rotary embedding (for the RoPE gate)."""
        rotary = self._layers[layer_idx].self_attn.rotary_emb
        query = torch.zeros(keys.shape[0], self._q_size, dtype=keys.dtype, device=keys.device)
        _, rotated = rotary(positions.to(torch.int64), query, keys.clone())
        return cast(torch.Tensor, rotated)

    def max_rope_position(self) -> int:
        """Positions vLLM's rotary embedding holds angles for (its table's rows; the model's context)."""
        return int(self._layers[0].self_attn.rotary_emb.max_position_embeddings)

    def raw_keys(self, layer_idx: int, token_ids: torch.Tensor) -> torch.Tensor:
        """The layer's K ``[n, Hkv*D]`` of the embedded ``token_ids``, before RoPE (a probe for the RoPE gate)."""
        layer = self._layers[layer_idx]
        qkv, _ = layer.self_attn.qkv_proj(layer.input_layernorm(self.embed(token_ids)[0]))
        return cast(torch.Tensor, qkv[:, self._q_size : self._q_size + self._kv_size].contiguous())

    def project(self, layer_idx: int, hidden: torch.Tensor, rotary: torch.Tensor) -> Projection:
        layer = self._layers[layer_idx]
        attention = layer.self_attn
        qkv, _ = attention.qkv_proj(layer.input_layernorm(hidden[0]))
        query, key, value = qkv.split([self._q_size, self._kv_size, self._kv_size], dim=-1)
        query, key = attention.rotary_emb(rotary, query.contiguous(), key.contiguous())
        num_tokens = hidden.shape[1]
        return Projection(
            query=query.view(num_tokens, self.num_heads, self.head_dim).transpose(0, 1)[None],
            key=key.view(num_tokens, self.num_kv_heads, self.head_dim).transpose(0, 1)[None],
            value=value.reshape(num_tokens, self.num_kv_heads, self.head_dim).transpose(0, 1)[None],
        )

    def attend_and_finish(
        self,
        layer_idx: int,
        hidden: torch.Tensor,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: QueryMask,
    ) -> torch.Tensor:
        layer = self._layers[layer_idx]
        attended = mask.attend(
            query, keys.permute(1, 0, 2)[None], values.permute(1, 0, 2)[None],
            scale=self.scaling, kv_groups=self.num_heads // self.num_kv_heads,
        )  # fmt: skip
        attended = attended.transpose(1, 2).reshape(hidden.shape[1], -1)
        output, _ = layer.self_attn.o_proj(attended)
        residual = hidden[0] + output
        return cast(torch.Tensor, residual + layer.mlp(layer.post_attention_layernorm(residual)))[None]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Not needed inside vLLM (vLLM computes the first token itself); refused so a caller notices."""
        raise NotImplementedError("inside vLLM the engine computes the logits; run the pass with need_logits=False")
