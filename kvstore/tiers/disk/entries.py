"""What the disk tier's index records about a chunk and hands out: entries, writes in flight, read tickets,
admission outcomes and counters (``DiskState`` owns them and changes the mutable ones under its lock).

Plain values; the mutable ones (``IndexEntry``, ``PendingWrite``, ``DiskCounters``) have one owner, the index.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvstore.tiers.base import ChunkRecord

__all__ = ["Admission", "DiskCounters", "IndexEntry", "PendingWrite", "ReadTicket"]


@dataclass(slots=True)
class PendingWrite:
    """A chunk queued for, or being, written: its bytes serve reads until the commit."""

    record: ChunkRecord
    data: npt.NDArray[np.uint8]
    num_readers: int = 0


@dataclass(slots=True)
class IndexEntry:
    """One resident chunk; owned by ``DiskState`` and changed only under its lock."""

    num_tokens: int
    raw_bytes: int
    stored_bytes: int
    num_frames: int
    frame_bytes: int
    last_access_ns: int
    num_pins: int = 0
    pending: PendingWrite | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadTicket:
    """Where a hit's bytes are: in a pending write (``pending``) or in ``num_frames`` LMDB frames."""

    raw_bytes: int
    num_frames: int
    frame_bytes: int
    pending: PendingWrite | None


@dataclass(slots=True)
class DiskCounters:
    puts: int = 0
    rejected_puts: int = 0
    evictions: int = 0
    corrupt_reads: int = 0
    write_errors: int = 0


class Admission(enum.Enum):
    """Outcome of ``DiskState.admit``."""

    ADMITTED = "admitted"
    ALREADY_RESIDENT = "already resident"
    NO_ROOM = "no room: pinned and pending chunks fill the capacity"
