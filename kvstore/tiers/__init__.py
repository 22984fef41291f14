"""Storage tiers behind one interface (``base``): gpu (device arena), cpu (host arena), disk (LMDB + zstd,
``kvstore.tiers.disk``). ``arena`` is the body of the gpu and cpu tiers."""

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
