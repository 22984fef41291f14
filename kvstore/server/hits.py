"""Lookup hits: per chunk (``kvstore inspect --url``'s most planned chunks, ``chunk`` replies) and per tier.

Per tier, because the tiers' own hit counters count reads (``get_into``), not lookups: a lookup pins a chunk in
the fastest tier holding it, so "which tier served the chunks of each prompt, and how many chunks no tier had" is
counted here, per lookup (``LookupTally``).

A bounded counter: when it tracks more than ``max_keys`` chunks it keeps the most-hit half, so memory stays
bounded on a server that sees millions of distinct chunks (the counts of chunks it dropped restart from zero;
the top of the list is what an operator looks at).

Threads: any. ``_counts_lock`` guards ``_counts``.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable

from kvstore.keys import PrefixKey, num_chunks
from kvstore.plan import LookupPlan
from kvstore.tiers.base import TierName

__all__ = ["HitCounter", "LookupTally"]


class HitCounter:
    """Hits per chunk key, at most ``max_keys`` keys.

    Args:
        max_keys: keys tracked before the least-hit half is dropped.
    """

    def __init__(self, max_keys: int = 100_000) -> None:
        self._max_keys = max_keys
        self._counts_lock = threading.Lock()
        self._counts: Counter[PrefixKey] = Counter()

    def add(self, keys: Iterable[PrefixKey]) -> None:
        with self._counts_lock:
            self._counts.update(keys)
            if len(self._counts) > self._max_keys:
                self._counts = Counter(dict(self._counts.most_common(self._max_keys // 2)))

    def hits(self, key: PrefixKey) -> int:
        with self._counts_lock:
            return self._counts.get(key, 0)

    def top(self, num_keys: int) -> list[tuple[PrefixKey, int]]:
        with self._counts_lock:
            return self._counts.most_common(num_keys)


class LookupTally:
    """Chunks planned from each tier, and prompt chunks no tier had, since the server started.

    Args:
        chunk_size: tokens per chunk (a prompt of ``n`` tokens is ``ceil(n / chunk_size)`` chunk lookups).
    """

    def __init__(self, chunk_size: int) -> None:
        self._chunk_size = chunk_size
        self._tally_lock = threading.Lock()
        self._hits: Counter[TierName] = Counter()
        self._misses = 0

    def add(self, plan: LookupPlan) -> None:
        hits = Counter(segment.tier for segment in plan.segments)
        misses = max(0, num_chunks(plan.num_query_tokens, self._chunk_size) - len(plan.segments))
        with self._tally_lock:
            self._hits.update(hits)
            self._misses += misses

    def snapshot(self) -> tuple[dict[TierName, int], int]:
        """``(hits by tier, misses)``."""
        with self._tally_lock:
            return dict(self._hits), self._misses
