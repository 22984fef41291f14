"""Lazy two-strike eviction of index entries whose chunk has left every tier.

Tiers evict without telling the fingerprint index (the disk tier drops chunks deep inside its writer thread), so
the index learns that a chunk is gone only when a lookup trips over it. Removing the entry at the first miss would
be wrong in three cases, hence the rules:

1. a lookup that finds an entry whose chunk is in no tier gives it a **strike**; the **second** strike removes it
   (one miss may be a race with a re-store that is about to bring the chunk back);
2. an entry whose registration is still **pending** is never struck (its chunk is being written right now);
3. a miss caused by a **full tier** (the chunk is in transit: being demoted or filled to make room) is a capacity
   miss, not absence: no strike;
4. a chunk that is **found again** (by a lookup, or stored again) clears its strikes.

``StrikeBook`` applies the rules to what the store observed; it holds no tier or index reference.

Threads: safe to share; ``_strikes_lock`` guards the counts.
"""

from __future__ import annotations

import enum
import threading

from kvstore.keys import PrefixKey

__all__ = ["StrikeBook", "Verdict"]


class Verdict(enum.Enum):
    """What a lookup should do with an index entry."""

    FOUND = "found"  # the chunk is resident: use it (its strikes are cleared)
    SHIELDED = "shielded"  # not usable now, but pending or in transit: no strike
    STRUCK = "struck"  # gone: first strike, keep the entry for now
    REMOVE = "remove"  # gone twice: remove the entry from the index


class StrikeBook:
    """Strike counts of index entries whose chunks went missing.

    Args:
        strikes_to_remove: strikes after which an entry is removed (2: the lazy two-strike rule).
    """

    def __init__(self, strikes_to_remove: int = 2) -> None:
        self._strikes_to_remove = strikes_to_remove
        self._strikes_lock = threading.Lock()
        self._strikes: dict[PrefixKey, int] = {}
        self._num_strikes = 0
        self._num_removals = 0

    def judge(self, key: PrefixKey, *, resident: bool, pending: bool, in_transit: bool) -> Verdict:
        """Apply the rules to one entry a lookup found.

        Args:
            key: the entry's key.
            resident: some tier holds the chunk.
            pending: the chunk's registration has not run yet.
            in_transit: a tier is moving the chunk to make room (a capacity miss).
        """
        with self._strikes_lock:
            if resident:
                self._strikes.pop(key, None)
                return Verdict.FOUND
            if pending or in_transit:
                return Verdict.SHIELDED
            self._num_strikes += 1
            count = self._strikes.get(key, 0) + 1
            if count >= self._strikes_to_remove:
                self._strikes.pop(key, None)
                self._num_removals += 1
                return Verdict.REMOVE
            self._strikes[key] = count
            return Verdict.STRUCK

    def clear(self, key: PrefixKey) -> None:
        """Forget a key's strikes (it was stored again)."""
        with self._strikes_lock:
            self._strikes.pop(key, None)

    def strikes(self, key: PrefixKey) -> int:
        with self._strikes_lock:
            return self._strikes.get(key, 0)

    @property
    def num_strikes(self) -> int:
        """Strikes given since the store opened."""
        with self._strikes_lock:
            return self._num_strikes

    @property
    def num_removals(self) -> int:
        """Entries removed by their second strike since the store opened."""
        with self._strikes_lock:
            return self._num_removals
