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

- ``sdpa``: ``scaled_dot_product_attention`` with one additive mask (every masked-out score is computed). Any
  device, any torch. On the CPU the sorted queries go in row groups, each over the keys up to its last position,
  which skips about half the masked-out work.
- ``flex``: ``torch.nn.attention.flex_attention`` compiled (CUDA) with a block mask: whole key blocks past a
  query block's last position are skipped, partial blocks are masked in the kernel, and grouped-query heads are
  read without being repeated. On the CPU it runs uncompiled (a reference, for tests).

``auto`` is ``flex`` on CUDA and ``sdpa`` elsewhere. The queries in order over every position ``0..T-1`` are plain
causal attention either way (sdpa's ``is_causal``: the flash kernel).
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as functional

from kvstore.blend.config import AttentionKernel

__all__ = ["AttentionKernel", "QueryMask"]

logger = logging.getLogger(__name__)

_MASK_ALIGN_ELEMENTS = 16  # fused attention kernels want the mask's rows 16-element aligned
_FLEX_QUERY_BLOCK = 128  # flex attention's query block: whole blocks only (a 50-query set failed to compile)
_CPU_GROUP_ROWS = 128  # sorted queries per sdpa call on the CPU (see _SdpaMask)
_CPU_MAX_GROUPS = 16


@functools.cache
def _flex_attention(compiled: bool) -> Callable[..., torch.Tensor]:
    """flex_attention, compiled once per process for CUDA (dynamic shapes: every prompt has its own lengths)."""
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return cast(Callable[..., torch.Tensor], flex_attention)
    return cast(Callable[..., torch.Tensor], torch.compile(flex_attention, dynamic=True))


class _FlexState:
    """Whether flex attention failed once in this process (no compiler, an old Triton, ...): ``auto`` then stays on
    sdpa for the process's lifetime instead of failing (and logging) on every layer."""

    broken = False


class _SdpaMask:
    """The additive mask ``[1, 1, n, T]`` (rows 16-aligned) and the sdpa calls that read it.

    On an accelerator: one call over the whole query set. Cutting the queries into groups that read only the keys up
    to their last position was no faster on an H200 in isolation and much slower inside a blended prefill, where
    every group of every prompt is a new shape for the kernel. On the CPU the groups pay (no kernel is specialised
    per shape): row groups of about ``_CPU_GROUP_ROWS`` sorted queries, each over the keys up to its last position,
    skip about half the masked-out scores and took 0.64-0.75x the time of the one call (measured:
    docs/design-notes.md#blend-query-attention).
    """

    def __init__(self, query_positions: torch.Tensor, num_keys: int, dtype: torch.dtype) -> None:
        device = query_positions.device
        padded_keys = -(-num_keys // _MASK_ALIGN_ELEMENTS) * _MASK_ALIGN_ELEMENTS
        allowed = torch.arange(num_keys, device=device)[None, :] <= query_positions[:, None]
        bias = torch.zeros((1, 1, int(query_positions.numel()), padded_keys), dtype=dtype, device=device)
        bias[..., :num_keys].masked_fill_(~allowed, float("-inf"))
        self.bias = bias[..., :num_keys]
        self.row_groups = _cpu_row_groups(query_positions, num_keys) if device.type == "cpu" else None

    def attend(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, kv_groups: int
    ) -> torch.Tensor:
        if kv_groups > 1:  # the kernels that take a mask do not take enable_gqa
            keys = keys.repeat_interleave(kv_groups, dim=1)
            values = values.repeat_interleave(kv_groups, dim=1)
        if self.row_groups is None:
            return functional.scaled_dot_product_attention(query, keys, values, attn_mask=self.bias, scale=scale)
        attended = [
            functional.scaled_dot_product_attention(
                query[:, :, first:last],
                keys[:, :, :seen],
                values[:, :, :seen],
                attn_mask=self.bias[:, :, first:last, :seen],
                scale=scale,
            )
            for first, last, seen in self.row_groups
        ]
        return torch.cat(attended, dim=2)


def _cpu_row_groups(query_positions: torch.Tensor, num_keys: int) -> tuple[tuple[int, int, int], ...]:
    """``(first_row, end_row, keys_seen)`` of consecutive groups of the sorted queries, each group reading the keys
    up to its last query's position: at most ``_CPU_MAX_GROUPS`` groups of at least ``_CPU_GROUP_ROWS`` rows."""
    num_queries = int(query_positions.numel())
    num_groups = max(1, min(_CPU_MAX_GROUPS, num_queries // _CPU_GROUP_ROWS))
    ends = [num_queries * (group + 1) // num_groups for group in range(num_groups)]
    seen = (query_positions[torch.tensor(ends) - 1] + 1).clamp(max=num_keys).tolist()
    firsts = [0, *ends[:-1]]
    return tuple(zip(firsts, ends, (int(count) for count in seen), strict=True))


class QueryMask:
    """Which keys each query token may attend to (those at positions up to its own), built once per query set.

    Args:
        query_positions: positions of the query tokens, sorted, on the model device.
        num_keys: tokens in the layer's KV (the prompt length).
        dtype: the model dtype (of the additive mask).
        kernel: how to attend (see the module docstring). With ``auto``, a flex attention that fails (e.g. no
            working compiler) is logged once and sdpa takes over for the rest of the process; an explicit
            ``flex`` raises instead.

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
        self._positions, self._num_keys, self._dtype = query_positions, num_keys, dtype
        self.num_queries = int(query_positions.numel())
        self.causal = self.num_queries == num_keys and bool(
            torch.equal(query_positions, torch.arange(num_keys, device=device))
        )
        self._fallback = kernel is AttentionKernel.AUTO
        self.kernel = kernel.resolve(device)
        if self._fallback and _FlexState.broken:
            self.kernel = AttentionKernel.SDPA
        self._sdpa: _SdpaMask | None = None
        self._block_mask: Any = None
        if not self.causal and self.kernel is AttentionKernel.FLEX:
            padding = -self.num_queries % _FLEX_QUERY_BLOCK
            if padding:  # padded rows repeat the last query's position: valid rows, dropped after the kernel
                query_positions = torch.cat([query_positions, query_positions[-1:].expand(padding)])
            self._block_mask = _block_mask(query_positions, num_keys)

    def attend(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *, scale: float, kv_groups: int
    ) -> torch.Tensor:
        """Attention output ``[1, H, n, D]`` of ``query`` ``[1, H, n, D]`` over ``keys``/``values``
        ``[1, Hkv, T, D]`` (``kv_groups`` query heads per KV head)."""
        if self.causal:
            return functional.scaled_dot_product_attention(
                query, keys, values, is_causal=True, scale=scale, enable_gqa=kv_groups > 1
            )
        if self.kernel is AttentionKernel.FLEX:
            try:
                return self._flex(query, keys, values, scale, kv_groups)
            except Exception as exc:
                if not self._fallback:
                    raise
                logger.warning("flex attention failed (%s: %s); attending with sdpa from now on",
                               type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")  # fmt: skip
                _FlexState.broken = True
                self.kernel = AttentionKernel.SDPA
        if self._sdpa is None:
            self._sdpa = _SdpaMask(self._positions, self._num_keys, self._dtype)
        return self._sdpa.attend(query, keys, values, scale, kv_groups)

    def _flex(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, kv_groups: int
    ) -> torch.Tensor:
        """Flex attention on contiguous head-major q/k/v.

        The pass hands over views (q from ``[1, n, H, D]`` storage, K/V from the token-major cache ``[T, Hkv, D]``) and
        the compiled kernel ran much slower on them than on contiguous copies, which cost far less than they save
        (measured: docs/design-notes.md#blend-query-attention).
        """
        compiled = query.device.type == "cuda"
        padding = -self.num_queries % _FLEX_QUERY_BLOCK
        query = functional.pad(query, (0, 0, 0, padding)) if padding else query.contiguous()
        keys, values = keys.contiguous(), values.contiguous()  # head-major copies: see _flex's docstring
        with warnings.catch_warnings():
            if not compiled:  # the CPU reference is uncompiled on purpose
                warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            attended = _flex_attention(compiled)(
                query, keys, values, block_mask=self._block_mask, scale=scale, enable_gqa=kv_groups > 1
            )
        return attended[:, :, : self.num_queries]


def _block_mask(query_positions: torch.Tensor, num_keys: int) -> Any:
    """The flex block mask of sorted query positions over ``num_keys`` keys, built from the block structure.

    For a block of 128 sorted queries with positions ``lo..hi``, the key blocks wholly at or before ``lo`` are
    visible to every query in it (no mask needed), the blocks from there to ``hi``'s block are partial (the mask
    decides per score), and the rest are skipped. A handful of tensor ops with no host sync, where
    ``create_block_mask`` (which evaluates the mask over the whole grid, and whose host work sat on the critical
    path right after the selection's sync) was slow per prompt on the H200 (measured:
    docs/design-notes.md#blend-query-attention). Queries are padded to whole blocks.
    """
    from torch.nn.attention.flex_attention import BlockMask

    block = _FLEX_QUERY_BLOCK
    device = query_positions.device
    num_key_blocks = -(-num_keys // block)
    firsts, lasts = query_positions[::block], query_positions[block - 1 :: block]
    full_counts = torch.div(firsts + 1, block, rounding_mode="floor")  # blocks ending at or before the first query
    partial_counts = torch.clamp(torch.div(lasts, block, rounding_mode="floor") - full_counts + 1, min=0)
    offsets = torch.arange(num_key_blocks, device=device)
    full_indices = offsets.expand(firsts.numel(), num_key_blocks)
    partial_indices = torch.clamp(full_counts[:, None] + offsets[None, :], max=num_key_blocks - 1)

    def sees(batch: torch.Tensor, head: torch.Tensor, query_idx: torch.Tensor, key_idx: torch.Tensor) -> torch.Tensor:
        return key_idx <= query_positions[query_idx]

    as_int32 = functools.partial(torch.Tensor.to, dtype=torch.int32)
    return BlockMask.from_kv_blocks(
        as_int32(partial_counts)[None, None],
        as_int32(partial_indices)[None, None].contiguous(),
        as_int32(full_counts)[None, None],
        as_int32(full_indices)[None, None].contiguous(),
        BLOCK_SIZE=block,
        mask_mod=sees,
        seq_lengths=(int(query_positions.numel()), num_keys),
    )
