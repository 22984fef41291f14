"""The gpu tier: chunk slots in device memory (HBM), demoting to the cpu tier on eviction.

The arena logic is shared with the cpu tier, so tests run it with ``device="cpu"`` on machines without CUDA.
"""

from __future__ import annotations

import torch

from kvstore.errors import ConfigError
from kvstore.layout import KVLayout
from kvstore.tiers.arena import ArenaTier
from kvstore.tiers.base import SpillCallback, TierName

__all__ = ["GpuTier"]


class GpuTier(ArenaTier):
    """Device-memory LRU tier.

    Args:
        layout: the KV layout every chunk has.
        chunk_size: tokens per full chunk.
        capacity_bytes: device memory to preallocate (whole slots).
        device: a CUDA device (``"cuda"``, ``"cuda:1"``), or ``"cpu"`` to exercise the logic without a GPU.
        spill: where victims go (the store wires the cpu tier here).
    """

    def __init__(
        self,
        layout: KVLayout,
        chunk_size: int,
        capacity_bytes: int,
        *,
        device: str | torch.device = "cuda",
        spill: SpillCallback | None = None,
    ) -> None:
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(
                "the gpu tier needs CUDA, but torch sees no CUDA device; "
                "drop 'gpu' from --tiers (e.g. --tiers cpu,disk)"
            )
        super().__init__(TierName.GPU, layout, chunk_size, capacity_bytes, device=device, spill=spill)
