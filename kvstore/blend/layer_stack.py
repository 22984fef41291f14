"""``LayerStack``: what the layerwise pass needs from a model, so one pass runs on Hugging Face and vLLM modules.

A blended prefill computes different tokens in different layers and attends over KV that is partly cached, so it
drives a model's modules itself, one decoder layer at a time. Two implementations: ``LlamaStack``
(``llama_layers``, a transformers model) and ``VllmLlamaStack`` (``kvstore.blend.vllm.llama_stack``, the modules of a
model vLLM loaded). The pass treats ``rotary``'s value as opaque: each stack keeps RoPE in its own form (a cos/sin
table, or the positions its in-place rotary op needs).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from kvstore.blend.llama_layers import Projection
from kvstore.blend.query_attention import QueryMask

__all__ = ["LayerStack"]


class LayerStack(Protocol):
    """A decoder-only model seen as embedding -> decoder layers -> LM head, on any subset of a prompt's tokens."""

    device: torch.device
    dtype: torch.dtype
    head_dim: int
    num_kv_heads: int

    @property
    def num_layers(self) -> int: ...

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[1, n, hidden]`` of ``token_ids`` ``[n]``."""
        ...

    def rotary(self, hidden: torch.Tensor, positions: torch.Tensor) -> Any:
        """RoPE at ``positions``, in whatever form ``project`` takes it."""
        ...

    def project(self, layer_idx: int, hidden: torch.Tensor, rotary: Any) -> Projection:
        """A layer's fresh q/k/v of the tokens of ``hidden``, RoPE applied."""
        ...

    def attend_and_finish(
        self,
        layer_idx: int,
        hidden: torch.Tensor,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: QueryMask,
    ) -> torch.Tensor:
        """The rest of the layer: attention over the layer's K/V ``[T, Hkv, D]``, o_proj, residual, MLP, residual."""
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[vocab]`` of the last token of ``hidden``."""
        ...
