"""Storage tiers: the local ones behind one interface (``base.Tier``), the shared one behind another
(``shared.SharedTier``), and the stored frame those outside memory keep chunks in.

- ``base``: the ``Tier`` interface every local tier implements, and the values that cross it;
- ``names``: ``TierName``, the tiers fastest first, importable without torch;
- ``arena``: preallocated chunk slots with LRU eviction and pins, the body of the gpu and cpu tiers;
- ``gpu``: chunk slots in device memory, demoting to the cpu tier on eviction;
- ``cpu``: chunk slots in host RAM, page-locked when CUDA is present;
- ``memfd_arena``: an arena kept in a sealed memory file, for same-host clients to read chunks in place;
- ``disk``: chunks in LMDB, compressed per frame, kept across restarts;
- ``residency``: the residency changes a tier reports to whoever mirrors what the store holds (KV events);
- ``shared``: ``SharedTier``, the contract of a tier many hosts share;
- ``remote``: the shared tier in Valkey (or Redis), with its fleet-wide content directory;
- ``frames``: the stored frame (meta value, codec, host copies) the disk and the remote tier share.

No tier imports another; ``frames`` is below both tiers that use it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from kvstore.tiers.base import ChunkRecord, Tier, TierName, TierStats
    from kvstore.tiers.cpu import CpuTier
    from kvstore.tiers.disk.tier import DiskTier
    from kvstore.tiers.gpu import GpuTier

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "kvstore.tiers.base": ("ChunkRecord", "Tier", "TierName", "TierStats"),
        "kvstore.tiers.cpu": ("CpuTier",),
        "kvstore.tiers.disk.tier": ("DiskTier",),
        "kvstore.tiers.gpu": ("GpuTier",),
    },
)
__all__ = ["ChunkRecord", "CpuTier", "DiskTier", "GpuTier", "Tier", "TierName", "TierStats"]
