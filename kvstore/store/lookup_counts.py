"""Hits and misses per tier, counted where lookups are planned (the definition is ``TierStats``'s docstring).

The tiers cannot count hits themselves: a lookup pins a chunk in the fastest tier holding it without reading it,
and a read (``get_into``) happens later, or never, or from a promoted copy. So the store counts each plan once,
as it hands it out: every planned chunk is a hit of the tier it was planned from and a miss of every other tier;
every prompt chunk no segment covers is a miss of every tier.

Threads: any (one lock, held for a few additions per lookup).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from collections.abc import Sequence

from kvstore.keys import num_chunks
from kvstore.misses import Miss, MissReason, tokens_by_reason
from kvstore.plan import Segment
from kvstore.stats import LookupTotals
from kvstore.tiers.base import TierName, TierStats

__all__ = ["LookupCounts"]


class LookupCounts:
    """Chunks looked up, and how many each tier served, since the store opened."""

    def __init__(self, chunk_size: int) -> None:
        self._chunk_size = chunk_size
        self._lock = threading.Lock()
        self._served: Counter[TierName] = Counter()
        self._looked_up = 0
        self._looked_up_tokens = 0
        self._missed_tokens: Counter[MissReason] = Counter()

    def add(
        self,
        num_query_tokens: int,
        segments: list[Segment],
        misses: Sequence[Miss] = (),
        *,
        num_query_chunks: int | None = None,
    ) -> None:
        """Count one plan: its segments (one chunk each), the prompt chunks they leave uncovered, and its tokens
        looked up and missed by reason (``num_query_chunks``: the prompt's chunks as the store cut it; ``None``:
        ``ceil(num_query_tokens / chunk_size)``, the fixed cut's count)."""
        served = Counter(segment.tier for segment in segments)
        if num_query_chunks is None:
            num_query_chunks = num_chunks(num_query_tokens, self._chunk_size)
        looked_up = max(num_query_chunks, len(segments))
        missed = tokens_by_reason(misses)
        with self._lock:
            self._served.update(served)
            self._looked_up += looked_up
            self._looked_up_tokens += num_query_tokens
            self._missed_tokens.update(missed)

    def add_dropped(self, dropped: Sequence[Miss], start: int) -> None:
        """Count the planned tokens from ``start`` on that a retrieve could not serve, by reason."""
        missed = tokens_by_reason(dropped, start)
        with self._lock:
            self._missed_tokens.update(missed)

    def totals(self) -> LookupTotals:
        with self._lock:
            return LookupTotals(
                looked_up_tokens=self._looked_up_tokens,
                missed_tokens={reason.value: count for reason, count in sorted(self._missed_tokens.items())},
            )

    def apply(self, stats: TierStats) -> TierStats:
        """``stats`` with its tier's hits and misses."""
        with self._lock:
            hits = self._served[stats.tier]
            return dataclasses.replace(stats, hits=hits, misses=self._looked_up - hits)
