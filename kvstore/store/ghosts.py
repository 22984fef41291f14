"""The ghost table: which tier dropped a chunk last, so a lookup can tell "evicted from cpu" from "never stored".

It hears the tiers' residency changes (``tiers.residency``) beside whoever else watches them (the server's KV
events), through ``ResidencyRelay``. A removal records the key with its tier; a store forgets it. The table keeps
the last ``GHOST_CAPACITY`` removals (about 140 bytes each with its key: 35 MiB when full); a chunk dropped
before those, or before the store opened, reads as never stored.

Threads: called under the tiers' locks (so it only takes note, under a lock of its own) and read by lookups.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvstore.keys import PrefixKey
from kvstore.tiers.base import ChunkRecord, TierName
from kvstore.tiers.residency import SILENT, ResidencyListener

__all__ = ["GHOST_CAPACITY", "GhostTable", "ResidencyRelay"]

GHOST_CAPACITY = 1 << 18
"""Removals the ghost table remembers (the oldest are forgotten first)."""


class GhostTable:
    """The tier that last dropped each recently removed chunk.

    Args:
        capacity: removals to remember.
    """

    def __init__(self, capacity: int = GHOST_CAPACITY) -> None:
        self._capacity = capacity
        self._lock = threading.Lock()
        self._dropped_by: OrderedDict[PrefixKey, TierName] = OrderedDict()

    def stored(self, tier: TierName, record: ChunkRecord) -> None:
        with self._lock:
            self._dropped_by.pop(record.key, None)

    def removed(self, tier: TierName, keys: Sequence[PrefixKey]) -> None:
        with self._lock:
            for key in keys:
                self._dropped_by[key] = tier
                self._dropped_by.move_to_end(key)
            while len(self._dropped_by) > self._capacity:
                self._dropped_by.popitem(last=False)

    def dropped_by(self, key: PrefixKey) -> TierName | None:
        """The tier that dropped ``key`` last (``None``: not within the table's reach)."""
        with self._lock:
            return self._dropped_by.get(key)

    def __len__(self) -> int:
        with self._lock:
            return len(self._dropped_by)


class ResidencyRelay:
    """The one listener a tier holds, passing each change to the ghost table and to one outside watcher.

    Args:
        ghosts: always told first.
    """

    def __init__(self, ghosts: GhostTable) -> None:
        self._ghosts = ghosts
        self._watcher: ResidencyListener = SILENT

    def watch(self, listener: ResidencyListener) -> None:
        """Tell ``listener`` of the changes from now on, instead of the previous watcher (``SILENT``: nobody)."""
        self._watcher = listener

    def stored(self, tier: TierName, record: ChunkRecord) -> None:
        self._ghosts.stored(tier, record)
        self._watcher.stored(tier, record)

    def removed(self, tier: TierName, keys: Sequence[PrefixKey]) -> None:
        self._ghosts.removed(tier, keys)
        self._watcher.removed(tier, keys)
