"""Chunks the disk tier evicts for room, read out just before they are deleted, for a tier below it.

With the remote tier's ``evict`` write policy a chunk reaches the remote only when it leaves the disk, so the
remote holds what no local tier keeps any more. The writer thread reads each capacity victim's meta record and
encoded frames (the bytes the remote stores too: nothing is decoded or re-encoded) in one read transaction and
hands them to the store's callback before the delete commits. Chunks deleted for any other reason (an admin
``evict``, a failed checksum) are not handed over.

Threads: the disk writer thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.keys import PrefixKey
from kvstore.tiers.disk.environment import DiskEnvironment
from kvstore.tiers.disk.format import frame_key

__all__ = ["EvictedChunk", "EvictionSink", "read_evicted"]


@dataclass(frozen=True, slots=True)
class EvictedChunk:
    """A capacity victim as the disk held it.

    Attributes:
        key: its prefix key.
        meta: its meta record (``kvstore.tiers.disk.format``), checksum included.
        frames: its encoded frames, in order.
    """

    key: PrefixKey
    meta: bytes
    frames: tuple[bytes, ...]


EvictionSink = Callable[[Sequence[EvictedChunk]], None]
"""Receives the victims of one eviction on the writer thread; it must only queue work (it holds the writer)."""


def read_evicted(env: DiskEnvironment, keys: Sequence[PrefixKey]) -> list[EvictedChunk]:
    """The victims' meta records and frames (copied out of the map); chunks missing a record are skipped."""
    chunks: list[EvictedChunk] = []
    with env.read() as txn:
        for key in keys:
            meta = txn.get(key, db=env.meta_db)
            if meta is None:
                continue
            frames: list[bytes] = []
            while (frame := txn.get(frame_key(key, len(frames)), db=env.payload_db)) is not None:
                frames.append(bytes(frame))
            if frames:
                chunks.append(EvictedChunk(key=key, meta=bytes(meta), frames=tuple(frames)))
    return chunks
