"""Residency changes of a tier, told to whoever mirrors what the store holds (the server's KV events for routers).

A tier tells its listener of every chunk that becomes resident (``stored``) and every chunk that stops being
resident (``removed``: evicted, spilled out, dropped as corrupt, a write abandoned), at the moment its own index
changes and under the lock that guards it, so the calls for one key arrive in the order the changes happened.
A listener must therefore only take note (append to a queue) and return: never block, never call into a tier.
Closing a store tells nothing (the process is going away); a listener that outlives it starts over from a snapshot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvstore.keys import PrefixKey
from kvstore.tiers.base import ChunkRecord, TierName

__all__ = ["SILENT", "ResidencyListener"]


class ResidencyListener(Protocol):
    """Hears a tier's residency changes (see the module docstring for what it may do)."""

    def stored(self, tier: TierName, record: ChunkRecord) -> None: ...

    def removed(self, tier: TierName, keys: Sequence[PrefixKey]) -> None: ...


class _Silent:
    """The listener of a tier nobody watches."""

    def stored(self, tier: TierName, record: ChunkRecord) -> None:
        pass

    def removed(self, tier: TierName, keys: Sequence[PrefixKey]) -> None:
        pass


SILENT: ResidencyListener = _Silent()
