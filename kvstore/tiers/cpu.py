"""The cpu tier: host RAM chunk slots, page-locked when CUDA is present so promotion to the GPU runs at the
pinned host-to-device rate, far above the pageable one (measured: docs/design-notes.md#tiers-cpu)."""

from __future__ import annotations

import torch

from kvstore.layout import KVLayout
from kvstore.tiers.arena import ArenaTier
from kvstore.tiers.base import SpillCallback, TierName

__all__ = ["CpuTier"]


class CpuTier(ArenaTier):
    """Host-memory LRU tier.

    Args:
        layout: the KV layout every chunk has.
        chunk_size: tokens per full chunk.
        capacity_bytes: host memory to preallocate (whole slots).
        pin_memory: page-lock the arena; ``None`` means "when CUDA is available".
        spill: where victims go (the store wires the disk tier here).
        shared_memory: keep the arena in a memory file same-host clients map, when it is not page-locked
            (``ArenaTier``).
    """

    def __init__(
        self,
        layout: KVLayout,
        chunk_size: int,
        capacity_bytes: int,
        *,
        pin_memory: bool | None = None,
        spill: SpillCallback | None = None,
        shared_memory: bool = False,
    ) -> None:
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        super().__init__(
            TierName.CPU,
            layout,
            chunk_size,
            capacity_bytes,
            device="cpu",
            pin_memory=pin_memory,
            spill=spill,
            shared_memory=shared_memory,
        )
