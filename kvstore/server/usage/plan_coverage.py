"""How one lookup plan covers its prompt: exact, blend and gap tokens, chunks per tier, missed chunks -- counted in
one pass over its segments, for the lookup metrics (``kvstore.server.metrics``).

Pure values; thread-safe.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.keys import num_chunks
from kvstore.plan import LookupPlan
from kvstore.tiers.base import TierName

__all__ = ["PlanCoverage"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanCoverage:
    """How one lookup plan covers its prompt.

    Args:
        num_query_tokens: the prompt's length.
        num_exact_tokens: tokens covered by exact segments.
        num_prefix_tokens: leading tokens covered by exact segments without a gap (``LookupPlan.num_prefix_tokens``,
            what a prefix-only engine skips): the engine's hit tokens in the metrics.
        num_blend_tokens: tokens covered by blend segments.
        num_chunks_by_tier: segments (planned chunks) per tier holding them; tiers without any are left out.
        num_missed_chunks: prompt chunks no segment covers.
    """

    num_query_tokens: int
    num_exact_tokens: int
    num_prefix_tokens: int
    num_blend_tokens: int
    num_chunks_by_tier: dict[TierName, int]
    num_missed_chunks: int

    @classmethod
    def of(cls, plan: LookupPlan, chunk_size: int) -> PlanCoverage:
        """Count ``plan`` (a prompt of ``n`` tokens is ``ceil(n / chunk_size)`` chunks)."""
        num_exact_tokens = num_prefix_tokens = num_blend_tokens = 0
        in_prefix = True  # exact segments from position 0 without a gap (``plan.exact_prefix_tokens``)
        by_tier: dict[TierName, int] = {}
        for segment in plan.segments:
            if segment.exact:
                num_exact_tokens += segment.num_tokens
            else:
                num_blend_tokens += segment.num_tokens
            in_prefix = in_prefix and segment.exact and segment.start == num_prefix_tokens
            if in_prefix:
                num_prefix_tokens = segment.end
            by_tier[segment.tier] = by_tier.get(segment.tier, 0) + 1
        return cls(
            num_query_tokens=plan.num_query_tokens,
            num_exact_tokens=num_exact_tokens,
            num_prefix_tokens=num_prefix_tokens,
            num_blend_tokens=num_blend_tokens,
            num_chunks_by_tier=by_tier,
            num_missed_chunks=max(0, num_chunks(plan.num_query_tokens, chunk_size) - len(plan.segments)),
        )

    @property
    def num_gap_tokens(self) -> int:
        """Tokens no segment covers (to compute)."""
        return self.num_query_tokens - self.num_exact_tokens - self.num_blend_tokens
