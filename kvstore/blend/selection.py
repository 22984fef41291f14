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

Pure functions on tensors; thread-safe.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from kvstore.errors import InvalidInputError
from kvstore.plan import Segment

__all__ = [
    "DeviationMetric",
    "num_tokens_to_recompute",
    "reused_span_starts",
    "select_tokens",
    "span_head_positions",
    "token_deviation",
]


class DeviationMetric(enum.StrEnum):
    """What a cached token's deviation is measured on at the check layer.

    ``KEY`` is CacheBlend's (and LMCache's) choice; ``VALUE`` looks at V alone, ``KEY_VALUE`` adds the two (which
    also sees tokens whose attention output changed without their key moving).
    """

    KEY = "key"
    VALUE = "value"
    KEY_VALUE = "key_value"


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


def select_tokens(
    *,
    deviation: torch.Tensor,
    cached_positions: torch.Tensor,
    forced_positions: torch.Tensor,
    recompute_ratio: float,
) -> torch.Tensor:
    """The prompt positions to recompute after the check layer, sorted ascending.

    Args:
        deviation: ``[num_cached]`` deviation of each cached (blend) token, aligned with ``cached_positions``.
        cached_positions: int64 positions of the cached tokens the ratio chooses among.
        forced_positions: int64 positions recomputed whatever their deviation (gaps and the last token); they must
            not appear in ``cached_positions`` except the last token, which may.
        recompute_ratio: fraction of the cached tokens to recompute, in ``[0, 1]``.

    Returns:
        int64 positions, unique and sorted, on ``cached_positions``' device.

    Raises:
        InvalidInputError: ``deviation`` and ``cached_positions`` differ in length.
    """
    if deviation.shape != cached_positions.shape:
        raise InvalidInputError(
            f"deviation {list(deviation.shape)} must have one value per cached position {list(cached_positions.shape)}"
        )
    count = num_tokens_to_recompute(recompute_ratio, int(cached_positions.numel()))
    chosen = cached_positions[torch.topk(deviation, count, sorted=False).indices] if count else cached_positions[:0]
    selected: torch.Tensor = torch.unique(torch.cat([chosen, forced_positions.to(cached_positions.device)]))
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
