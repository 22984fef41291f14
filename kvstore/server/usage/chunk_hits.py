"""Hits per chunk: how many lookup plans used each chunk (``kvstore inspect --url``'s most planned chunks,
``chunk`` replies).

A bounded counter: when it tracks more than ``max_keys`` chunks it keeps the most-hit half, so memory stays
bounded on a server that sees millions of distinct chunks (the counts of chunks it dropped restart from zero;
the top of the list is what an operator looks at).

Threads: any. ``_counts_lock`` guards ``_counts``.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable

from kvstore.keys import PrefixKey

__all__ = ["ChunkHitCounter"]


class ChunkHitCounter:
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
