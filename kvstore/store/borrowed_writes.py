"""Writing a chunk through to a slower tier without copying it: the writer reads the pinned cpu slot in place.

A new chunk lands in a memory tier first; the disk (and a shared tier under write-through) then write it off the
caller's path. When it sits in a cpu slot, the slot is pinned for the writer, which reads it directly and unpins it
when done (``put_borrowed``); otherwise (a gpu slot, no free pin) the writer gets a copy (``put``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvstore.tiers.arena import ArenaTier
from kvstore.tiers.base import ChunkRecord, Tier

__all__ = ["write_borrowing"]


def write_borrowing(
    tier: Tier,
    record: ChunkRecord,
    kv: torch.Tensor,
    *,
    put: Callable[[ChunkRecord, torch.Tensor], bool],
    put_borrowed: Callable[[ChunkRecord, torch.Tensor, Callable[[], None]], bool],
) -> None:
    """Hand ``record`` (just put into ``tier``) to a writer: its pinned cpu slot in place, else a copy of ``kv``."""
    if isinstance(tier, ArenaTier) and tier.device.type == "cpu" and tier.pin(record.key):

        def unpin() -> None:
            tier.unpin(record.key)

        put_borrowed(record, tier.view(record.key), unpin)
    else:
        put(record, kv)
