"""Which tokens a blended prefill recomputes: the cached tokens whose KV deviates most, plus every uncached token.

CacheBlend's observation: a chunk's cached KV was computed without the prompt's other chunks in front of it, so its
cross-attention to them is missing; only a few tokens carry most of that difference, and they are the same tokens
in every layer. So at one early *check layer* every token is computed fresh, each cached token's fresh K (or K
and V) is compared with its cached (re-rotated) K/V, and the ``recompute_ratio`` of cached tokens that deviate most
are kept for recomputation in all later layers, together with the tokens that have no cached KV at all (gaps:
separators, the question) and the last token (its logits are the prefill's output)::

    deviation[i] = sum over heads and dims of (K_fresh[i] - K_cached[i])**2      (+ the same for V with KEY_VALUE)
    selected     = top ceil(ratio * num_cached) cached tokens by deviation  U  gap tokens  U  {last token}
                   (U  the first ``num_head_tokens`` of every reused span, when asked: ``span_head_positions``)

A *reused span* is a run of blend segments that continues one cached sequence (each segment starts where the
previous one ended, in the prompt and in the source). Its first tokens attended only to what preceded them where
the span was cached, typically nothing (a document stored alone starts at position 0: its first tokens are attention
sinks there, but not in the prompt). EPIC (Hu et al., 2024, "LegoLink") recomputes those few tokens of every chunk.

**Policies** (``SelectionPolicy``) choose the budget's tokens differently; the budget is always
``ceil(recompute_ratio * num_cached)`` of the cached tokens:

- ``kv_deviation``: the deviation above (CacheBlend's).
- ``query_attention``: the attention the prompt's computed tokens (the question, separators, the last token) pay
  each cached token at the check layer, summed over queries and heads: the cached tokens the question reads most
  are the ones whose stale KV hurts the answer most (ProphetKV, A3, CacheClip select this way).
- ``chunk_start``: the first ``chunk_start_tokens`` of every reused span (EPIC's sink repair), every span's first
  token before any span's second, while the budget lasts; the rest of the budget stays unused.
- ``chunk_start+query_attention`` / ``chunk_start+kv_deviation``: the span starts first, then the rest of the budget
  by the scorer.

Pure functions on tensors; thread-safe.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from kvstore.blend.config import DeviationMetric, SelectionPolicy
from kvstore.errors import InvalidInputError
from kvstore.plan import Segment

__all__ = [
    "DeviationMetric",
    "SelectionPolicy",
    "num_tokens_to_recompute",
    "query_attention_mass",
    "reused_span_starts",
    "select_tokens",
    "span_head_positions",
    "span_start_order",
    "token_deviation",
]


def token_deviation(
    metric: DeviationMetric,
    fresh_keys: torch.Tensor,
    cached_keys: torch.Tensor,
    fresh_values: torch.Tensor,
    cached_values: torch.Tensor,
) -> torch.Tensor:
    """Squared L2 distance per token between fresh and cached K, V or both (``metric``), in float32.

    Args:
        metric: what to compare.
        fresh_keys: ``[num_tokens, num_kv_heads, head_dim]`` computed at the check layer.
        cached_keys: the same tokens' cached K, already rotated to their positions.
        fresh_values: V of the same tokens.
        cached_values: their cached V.

    Returns:
        ``[num_tokens]`` float32.
    """
    deviation = torch.zeros(fresh_keys.shape[0], dtype=torch.float32, device=fresh_keys.device)
    if metric is not DeviationMetric.VALUE:
        deviation += (fresh_keys.float() - cached_keys.float()).square().sum(dim=(-2, -1))
    if metric is not DeviationMetric.KEY:
        deviation += (fresh_values.float() - cached_values.float()).square().sum(dim=(-2, -1))
    return deviation


def num_tokens_to_recompute(recompute_ratio: float, num_cached_tokens: int) -> int:
    """How many cached tokens a ratio selects: ``ceil(ratio * n)``, so any positive ratio picks at least one."""
    return min(num_cached_tokens, math.ceil(recompute_ratio * num_cached_tokens - 1e-9))


def query_attention_mass(
    query: torch.Tensor, query_positions: torch.Tensor, keys: torch.Tensor, *, block_queries: int = 64
) -> torch.Tensor:
    """The attention each key position receives from the queries, summed over queries and heads, in float32.

    Causal by absolute position: a query at ``p`` attends to keys ``0..p``. Grouped-query heads share their KV head.
    The queries are scored ``block_queries`` at a time, so memory stays ``O(heads * block_queries * T)``.

    Args:
        query: ``[num_heads, num_queries, head_dim]``, RoPE applied.
        query_positions: ``[num_queries]`` int64 positions of the queries.
        keys: ``[T, num_kv_heads, head_dim]`` of the whole prompt, RoPE applied.

    Returns:
        ``[T]`` float32: for each key position, the sum of its softmax weights.
    """
    num_heads, num_queries, head_dim = query.shape
    num_tokens, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    key_heads = keys.float().permute(1, 0, 2)  # [Hkv, T, D]
    key_positions = torch.arange(num_tokens, device=keys.device)
    mass = torch.zeros(num_tokens, dtype=torch.float32, device=keys.device)
    scale = 1.0 / math.sqrt(head_dim)
    for first in range(0, num_queries, block_queries):
        rows = slice(first, first + block_queries)
        block = query[:, rows].float().reshape(num_kv_heads, group, -1, head_dim)
        scores = torch.einsum("hgqd,htd->hgqt", block, key_heads) * scale
        future = key_positions[None, :] > query_positions[rows].to(keys.device)[:, None]  # [q, T]
        scores.masked_fill_(future, float("-inf"))
        mass += torch.softmax(scores, dim=-1).sum(dim=(0, 1, 2))
    return mass


def span_start_order(segments: Sequence[Segment], num_start_tokens: int, num_tokens: int) -> torch.Tensor:
    """The first ``num_start_tokens`` positions of every reused span (``reused_span_starts``), every span's first
    token before any span's second (so a budget too small for all of them still repairs every span's sink).

    Returns:
        int64 positions on the CPU, in that order.
    """
    starts = reused_span_starts(segments, num_tokens)
    positions = np.arange(num_tokens, dtype=np.int64)
    offsets = positions - starts
    heads = positions[(starts >= 0) & (offsets < num_start_tokens)]
    order = np.lexsort((heads, offsets[heads]))  # by offset in the span, then by position
    return torch.from_numpy(heads[order])


def select_tokens(
    *,
    scores: torch.Tensor | None,
    cached_positions: torch.Tensor,
    forced_positions: torch.Tensor,
    recompute_ratio: float,
    first_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """The prompt positions to recompute after the check layer, sorted ascending.

    The budget is ``num_tokens_to_recompute(recompute_ratio, len(cached_positions))``: ``first_positions`` take
    it first, in their order; the rest goes to the highest ``scores`` among the cached tokens not taken yet.

    Args:
        scores: ``[num_cached]`` rank of each cached (blend) token, aligned with ``cached_positions`` (deviation or
            attention mass), or ``None`` to spend only what ``first_positions`` take.
        cached_positions: int64 positions of the cached tokens the ratio chooses among.
        forced_positions: int64 positions recomputed whatever their score (gaps and the last token); they must
            not appear in ``cached_positions`` except the last token, which may.
        recompute_ratio: fraction of the cached tokens to recompute, in ``[0, 1]``.
        first_positions: int64 cached positions that come first in the budget (span starts), in priority order.

    Returns:
        int64 positions, unique and sorted, on ``cached_positions``' device.

    Raises:
        InvalidInputError: ``scores`` and ``cached_positions`` differ in length.
    """
    if scores is not None and scores.shape != cached_positions.shape:
        raise InvalidInputError(
            f"scores {list(scores.shape)} must have one value per cached position {list(cached_positions.shape)}"
        )
    device = cached_positions.device
    count = num_tokens_to_recompute(recompute_ratio, int(cached_positions.numel()))
    taken = cached_positions[:0]
    if first_positions is not None:
        taken = first_positions.to(device)[:count]
    remaining = count - int(taken.numel())
    if scores is not None and remaining > 0:
        free = ~torch.isin(cached_positions, taken)
        ranked = torch.topk(scores[free], min(remaining, int(free.sum())), sorted=False).indices
        taken = torch.cat([taken, cached_positions[free][ranked]])
    selected: torch.Tensor = torch.unique(torch.cat([taken, forced_positions.to(device)]))
    return selected  # unique() sorts


def reused_span_starts(segments: Sequence[Segment], num_tokens: int) -> npt.NDArray[np.int64]:
    """For each of ``num_tokens`` prompt positions, the start of the reused span holding it (-1 outside blend
    segments).

    A span is a maximal run of blend segments in which each segment continues the previous one both in the prompt
    (``start == previous.end``) and in the source (``source_start == previous source end``), i.e. one cached
    sequence placed as a whole; exact segments are skipped (and end a span).
    """
    starts = np.full(num_tokens, -1, dtype=np.int64)
    previous: Segment | None = None
    span_start = 0
    for segment in segments:
        if segment.exact:
            previous = None
            continue
        continues = (
            previous is not None
            and segment.start == previous.end
            and segment.source_start == previous.source_start + previous.num_tokens
        )
        if not continues:
            span_start = segment.start
        starts[segment.start : segment.end] = span_start
        previous = segment
    return starts


def span_head_positions(segments: Sequence[Segment], num_head_tokens: int, num_tokens: int) -> torch.Tensor:
    """The first ``num_head_tokens`` positions of every reused span (``reused_span_starts``) of a ``num_tokens``
    prompt; a span shorter than that contributes all its tokens.

    Returns:
        int64 positions on the CPU, sorted ascending.
    """
    starts = reused_span_starts(segments, num_tokens)
    positions = np.arange(num_tokens, dtype=np.int64)
    return torch.from_numpy(positions[(starts >= 0) & (positions < starts + num_head_tokens)])
