"""Chunks the disk tier evicts for room, read out just before they are deleted, for a tier below it.

With the remote tier's ``evict`` write policy a chunk reaches the remote only when it leaves the disk, so the
remote holds what no local tier keeps any more. The writer thread reads each capacity victim's meta record and
encoded frames (the bytes the remote stores too: nothing is decoded or re-encoded) in one read transaction and
hands them to the store's callback before the delete commits. Chunks deleted for any other reason (an admin
``evict``, a failed checksum) are not handed over.

Threads: the disk writer thread.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.keys import PrefixKey
from kvstore.tiers.disk.environment import DiskEnvironment
from kvstore.tiers.disk.format import frame_key
from kvstore.tiers.frames.evicted import EvictedChunk

__all__ = ["read_evicted"]


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
