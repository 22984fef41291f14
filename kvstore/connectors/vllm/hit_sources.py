"""Which kvstore tier the tokens of a hit come from: what vLLM counts per cache source for the external tokens.

vLLM asks a connector to split the external tokens it took for a request by the tier that supplied them
(``get_external_cache_hit_sources``; Prometheus ``vllm:prompt_tokens_cached_by_source``). One kvstore hit can come
from several tiers at once (its first chunks still in cpu memory, later ones only on disk), and a blend span holds
tokens that no tier supplies (its gaps, which the blend pass computes), so the split is counted from the plan's
segments over the exact token range, not named once per connector. vLLM throws away a split whose counts do not sum
to its token count (all of it becomes ``external_unspecified``), so every token of the range is counted once.

Pure arithmetic over a plan's segments; no engine imports (the connector maps tiers to vLLM's sources).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.plan import Segment
from kvstore.tiers.base import TierName

__all__ = ["tokens_by_tier"]


def tokens_by_tier(segments: Sequence[Segment], start: int, end: int) -> dict[TierName | None, int]:
    """How many tokens of ``[start, end)`` each tier's segments cover; ``None`` counts the tokens no segment covers.

    The counts sum to ``end - start`` and only non-zero counts appear (an empty range gives ``{}``).

    Args:
        segments: a plan's segments, sorted by ``start`` and non-overlapping (as ``LookupPlan.segments`` are).
        start: the range's first token.
        end: one past its last token.

    Raises:
        ValueError: the range is not one (``start`` negative or past ``end``), or the segments overlap or are out of
            order (each token would no longer be counted once).
    """
    if not 0 <= start <= end:
        raise ValueError(f"tokens_by_tier: [{start}, {end}) is not a range of token positions")
    counts: dict[TierName | None, int] = {}
    covered_to = 0
    for segment in segments:
        if segment.start < covered_to:
            raise ValueError(
                f"tokens_by_tier: the segment at token {segment.start} overlaps or precedes the one ending at "
                f"{covered_to}; a plan's segments are sorted and disjoint"
            )
        covered_to = segment.end
        overlap = min(segment.end, end) - max(segment.start, start)
        if overlap > 0:
            counts[segment.tier] = counts.get(segment.tier, 0) + overlap
    uncovered = end - start - sum(counts.values())
    if uncovered:
        counts[None] = uncovered
    return counts
