"""Attention of a subset of a prompt's tokens over the whole prompt's KV, causal by absolute position.

After the check layer a blended prefill computes ~15% of the tokens, scattered over the prompt, and each of them
attends to every key at a position up to its own::

    keys      0 ........................................................ T-1
    query at p=40    ####
    query at p=700   ###############
    query at p=9000  #############################################
    (# = allowed; the queries are sorted by position)

sdpa's flash kernel cannot express that (``is_causal`` aligns queries to the first or last keys, not to arbitrary
positions), so the pass needs a mask, and a kernel that reads a dense mask also computes every masked-out score:
with the queries spread evenly that is about twice the useful work. Two kernels, chosen by ``AttentionKernel``:

- ``sdpa``: ``scaled_dot_product_attention`` with an additive mask, the queries cut into groups of
  ``SDPA_GROUP_QUERIES`` that each read only the keys up to the group's last position (most of the masked-out
  work is never issued; the rest is inside a group's span). Any device, any torch.
- ``flex``: ``torch.nn.attention.flex_attention`` compiled (CUDA) with a block mask: whole key blocks past a
  query block's last position are skipped, partial blocks are masked in the kernel, and grouped-query heads are
  read without being repeated. On the CPU it runs uncompiled (a reference, for tests).

``auto`` is ``flex`` on CUDA and ``sdpa`` elsewhere. The queries in order over every position ``0..T-1`` are plain
causal attention either way (sdpa's ``is_causal``: the flash kernel).
"""

from __future__ import annotations

import enum
import functools
import logging
import warnings
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as functional

__all__ = ["SDPA_GROUP_QUERIES", "AttentionKernel", "QueryMask"]

logger = logging.getLogger(__name__)

SDPA_GROUP_QUERIES = 256
"""Queries per sdpa call: small enough that a group's span of positions (and so its masked-out work) is a small
part of the keys it reads, large enough that 15% of a 15k prompt is a handful of kernel launches per layer."""

_MASK_ALIGN_ELEMENTS = 16  # fused attention kernels want the mask's rows 16-element aligned


class AttentionKernel(enum.StrEnum):
    AUTO = "auto"
    SDPA = "sdpa"
    FLEX = "flex"

    def resolve(self, device: torch.device) -> AttentionKernel:
        if self is AttentionKernel.AUTO:
            return AttentionKernel.FLEX if device.type == "cuda" else AttentionKernel.SDPA
        return self


@functools.cache
def _flex_attention(compiled: bool) -> Callable[..., torch.Tensor]:
    """flex_attention, compiled once per process for CUDA (dynamic shapes: every prompt has its own lengths)."""
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return cast(Callable[..., torch.Tensor], flex_attention)
    return cast(Callable[..., torch.Tensor], torch.compile(flex_attention, dynamic=True))


class QueryMask:
    """Which keys each query token may attend to (those at positions up to its own), built once per query set.

    Args:
        query_positions: positions of the query tokens, sorted, on the model device.
        num_keys: tokens in the layer's KV (the prompt length).
        dtype: the model dtype (of the additive mask).
        kernel: how to attend (see the module docstring).

    ``causal`` is set when the queries are every position ``0..T-1`` in order (then sdpa's own causal path runs and
    no mask is built).
    """

    def __init__(
        self,
        query_positions: torch.Tensor,
        num_keys: int,
        dtype: torch.dtype,
        kernel: AttentionKernel = AttentionKernel.SDPA,
    ) -> None:
        device = query_positions.device
        self.num_queries = int(query_positions.numel())
        self.causal = self.num_queries == num_keys and bool(
            torch.equal(query_positions, torch.arange(num_keys, device=device))
        )
        self.kernel = kernel.resolve(device)
        self._groups: list[tuple[int, int, int]] = []
        self._bias: torch.Tensor | None = None
        self._block_mask: Any = None
        if self.causal:
            return
        if self.kernel is AttentionKernel.FLEX:
            self._block_mask = _block_mask(query_positions, num_keys)
            return
        padded_keys = -(-num_keys // _MASK_ALIGN_ELEMENTS) * _MASK_ALIGN_ELEMENTS
        key_positions = torch.arange(num_keys, device=device)
        allowed = key_positions[None, :] <= query_positions[:, None]
        bias = torch.zeros((1, 1, self.num_queries, padded_keys), dtype=dtype, device=device)
        bias[..., :num_keys].masked_fill_(~allowed, float("-inf"))
        self._bias = bias
        last_rows = list(range(SDPA_GROUP_QUERIES - 1, self.num_queries, SDPA_GROUP_QUERIES))
        if not last_rows or last_rows[-1] != self.num_queries - 1:
            last_rows.append(self.num_queries - 1)
        key_ends = (query_positions[last_rows] + 1).tolist()  # one host read per query set
        start = 0
        for last_row, key_end in zip(last_rows, key_ends, strict=True):
            self._groups.append((start, last_row + 1, int(key_end)))
            start = last_row + 1

    def attend(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *, scale: float, kv_groups: int
    ) -> torch.Tensor:
        """Attention output ``[1, H, n, D]`` of ``query`` ``[1, H, n, D]`` over ``keys``/``values``
        ``[1, Hkv, T, D]`` (``kv_groups`` query heads per KV head)."""
        if self.causal:
            return functional.scaled_dot_product_attention(
                query, keys, values, is_causal=True, scale=scale, enable_gqa=kv_groups > 1
            )
        if self._block_mask is not None:
            compiled = query.device.type == "cuda"
            with warnings.catch_warnings():
                if not compiled:  # the CPU reference is uncompiled on purpose
                    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
                return _flex_attention(compiled)(
                    query, keys, values, block_mask=self._block_mask, scale=scale, enable_gqa=kv_groups > 1
                )
        assert self._bias is not None
        if kv_groups > 1:  # the kernels that take a mask do not take enable_gqa
            keys = keys.repeat_interleave(kv_groups, dim=1)
            values = values.repeat_interleave(kv_groups, dim=1)
        if len(self._groups) == 1:
            return functional.scaled_dot_product_attention(
                query, keys, values, attn_mask=self._bias[..., : keys.shape[2]], scale=scale
            )
        parts = []
        for start, end, key_end in self._groups:
            bias = self._bias[:, :, start:end, :key_end]
            sliced_keys, sliced_values = keys[:, :, :key_end], values[:, :, :key_end]
            parts.append(
                functional.scaled_dot_product_attention(
                    query[:, :, start:end], sliced_keys, sliced_values, attn_mask=bias, scale=scale
                )
            )
        return torch.cat(parts, dim=2)


def _block_mask(query_positions: torch.Tensor, num_keys: int) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    def sees(batch: torch.Tensor, head: torch.Tensor, query_idx: torch.Tensor, key_idx: torch.Tensor) -> torch.Tensor:
        return key_idx <= query_positions[query_idx]

    return create_block_mask(
        sees, B=None, H=None, Q_LEN=int(query_positions.numel()), KV_LEN=num_keys, device=query_positions.device
    )
