"""The store: ``TieredStore`` and the modules it coordinates its tiers and its content index with.

- ``tiered``: ``TieredStore``, the coordinator (store, lookup, retrieve, release, sessions, stats).
- ``local_tiers``: ``LocalTiers``, the local tiers as one list, fastest first: opening them, spills into the next
  tier, write-through to the durable one, promotion into the fastest.
- ``chunk_writes``: a store call's writes, each chunk's outcome, and their content registration.
- ``borrowed_writes``: write-throughs that read a pinned cpu slot in place.
- ``lookup_legs``: a lookup's prefix leg (exact segments) and match leg (content anywhere).
- ``miss_attribution``: the reason each miss of a lookup or a retrieve gets (the reasons: ``kvstore.misses``).
- ``ghosts``: ``GhostTable``, the tier that last dropped each recently removed chunk, and ``ResidencyRelay``, every
  local tier's one residency listener.
- ``segment_loads``: which of a plan's segments a retrieve serves, and from where.
- ``retrieve_copies``: a retrieve's copies into the caller's buffer (memory chunks, disk decodes).
- ``lending``: a lent retrieve: where a plan's chunks lie in the shared cpu arena.
- ``pins``: ``PinLedger``, the pins each open plan holds, by session.
- ``prefetch``: promotions into the cpu tier that a lookup starts and a retrieve waits for.
- ``lookup_counts``: the hit and miss counters of lookups.
- ``fleet``: ``Fleet``, the shared tiers (``kvstore.tiers.shared.SharedTier``: the remote) and the fleet directory,
  with three parts:
- ``remote_reads``: a retrieve's reads of shared chunks (the fleet's).
- ``fleet_publish``: the runs this host publishes to the fleet directory.
- ``fleet_sync``: other hosts' runs, read into the content catalog.
- ``inspection``: an offline look at a data dir (``kvstore inspect``).

``TieredStore`` is imported when first used, so importing one of these modules does not load the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from kvstore.store.tiered import TieredStore

__getattr__, __dir__ = lazy_exports(__name__, {"kvstore.store.tiered": ("TieredStore",)})
__all__ = ["TieredStore"]
