"""Storage tiers behind one interface: gpu (device arena), cpu (host arena), disk (LMDB + zstd)."""

from kvstore.tiers.base import ChunkRecord, Tier, TierName, TierStats
from kvstore.tiers.cpu import CpuTier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.gpu import GpuTier

__all__ = ["ChunkRecord", "CpuTier", "DiskTier", "GpuTier", "Tier", "TierName", "TierStats"]
