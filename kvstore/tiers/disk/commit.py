"""How a chunk reaches LMDB whole or not at all: short write transactions, intent records and their recovery.

LMDB with ``writemap=False`` mallocs a buffer per multi-MiB value it writes and frees them all at commit: 16
frames of 4 MiB in one transaction cost several times the CPU of one frame per transaction (measured with py-lmdb:
docs/design-notes.md#tiers-disk-commit; glibc malloc tuning narrows the gap but does not close it). So the writer
commits a group's chunks as a sequence of short transactions, each holding at most ``max_transaction_bytes``
of frames (at least one frame), the chunks laid one after another::

    txn 1:  payload[K|0] ...            intent[K] = num_frames   (K's first frames; K does not exist yet)
    txn i:  payload[K|j] ...                                     (K's middle frames)
    txn n:  payload[K|last] ...         meta[K], del intent[K]   (K's last frames: K exists from this commit)

A chunk whose frames all fit one transaction gets no intent; a transaction may end one chunk and begin the
next. Deleting a chunk removes its meta, its frames and any intent in one transaction.

Invariants (after any crash, since each transaction is atomic):
- a ``meta`` record exists only when every frame it describes does: recovery builds the index from ``meta``
  alone, so a chunk is whole or absent, never torn.
- committed frames without a ``meta`` always have an ``intent`` record. ``remove_unfinished_chunks`` (at a
  writable open, before the index is built) deletes the frames of every leftover intent, so no orphan frame
  outlives a restart; it reads only the intent sub-database, which is empty after a clean run.

Threads: the disk writer thread (plans and write transactions) and the thread opening the tier, before the
writer starts (``remove_unfinished_chunks``). Plans are plain values owned by the writer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import lmdb

from kvstore.errors import StorageError
from kvstore.keys import PrefixKey
from kvstore.tiers.disk.environment import DiskEnvironment, storage_error
from kvstore.tiers.disk.format import encode_intent, frame_key

__all__ = [
    "ChunkFrames",
    "ChunkTransaction",
    "delete_chunks",
    "discard_unfinished",
    "plan_transactions",
    "remove_unfinished_chunks",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkFrames:
    """One encoded chunk ready to commit: its key, its meta value and its frames in order."""

    key: PrefixKey
    meta: bytes
    frames: tuple[memoryview, ...]


@dataclass(slots=True)
class ChunkTransaction:
    """One write transaction of a plan: frames to put, chunks it begins (intent) and ends (meta)."""

    frames: list[tuple[bytes, memoryview]] = field(default_factory=list)  # (payload key, encoded frame)
    begins: list[ChunkFrames] = field(default_factory=list)  # first frames here, last ones later: intent
    ends: list[ChunkFrames] = field(default_factory=list)  # last frame here: meta
    closed_intents: list[PrefixKey] = field(default_factory=list)  # ended here, begun earlier
    num_bytes: int = 0

    def write(self, txn: lmdb.Transaction[bytes], env: DiskEnvironment) -> None:
        """Put this transaction's records (idempotent, so a retry after a full map repeats it safely)."""
        intent_db = env.writable_intent_db()
        for chunk in self.begins:
            txn.put(chunk.key, encode_intent(len(chunk.frames)), db=intent_db)
        for key, frame in self.frames:
            txn.put(key, frame, db=env.payload_db)
        for chunk in self.ends:
            txn.put(chunk.key, chunk.meta, db=env.meta_db)
        for key in self.closed_intents:
            txn.delete(key, db=intent_db)


def plan_transactions(chunks: Sequence[ChunkFrames], max_transaction_bytes: int) -> list[ChunkTransaction]:
    """Cut the chunks' frames, in order, into transactions of at most ``max_transaction_bytes`` (one frame at least).

    Args:
        chunks: the chunks to commit, each with at least one frame.
        max_transaction_bytes: bound on the frame bytes of one transaction.

    Returns:
        The transactions to commit in order; chunk ``K`` exists once the one listing it in ``ends`` commits.
    """
    plan: list[ChunkTransaction] = []
    current = ChunkTransaction()
    for chunk in chunks:
        assert chunk.frames, f"chunk {chunk.key.hex()} has no frames: the writer cut an empty chunk"
        first: ChunkTransaction | None = None
        for frame_idx, frame in enumerate(chunk.frames):
            if current.frames and current.num_bytes + len(frame) > max_transaction_bytes:
                plan.append(current)
                current = ChunkTransaction()
            first = first or current
            current.frames.append((frame_key(chunk.key, frame_idx), frame))
            current.num_bytes += len(frame)
        current.ends.append(chunk)
        if first is not current:
            assert first is not None
            first.begins.append(chunk)
            current.closed_intents.append(chunk.key)
    if current.frames:
        plan.append(current)
    return plan


def delete_chunks(txn: lmdb.Transaction[bytes], env: DiskEnvironment, keys: Sequence[PrefixKey]) -> None:
    """Delete chunks' meta, frames and intents in ``txn`` (missing records are skipped)."""
    intent_db = env.writable_intent_db()
    for key in keys:
        txn.delete(key, db=env.meta_db)
        cursor = txn.cursor(db=env.payload_db)
        found = cursor.set_range(frame_key(key, 0))
        while found and cursor.key()[: len(key)] == key:
            found = cursor.delete()
        txn.delete(key, db=intent_db)


def remove_unfinished_chunks(env: DiskEnvironment) -> list[PrefixKey]:
    """Delete the frames of chunks whose meta never committed (a crash mid-chunk); returns their keys.

    Runs at a writable open, before the index is rebuilt; costs one read of the (normally empty) intent
    sub-database.

    Raises:
        StorageError: LMDB failed (a full map included).
    """
    intent_db = env.writable_intent_db()
    with env.read() as read_txn:
        keys = [PrefixKey(bytes(key)) for key in read_txn.cursor(db=intent_db).iternext(keys=True, values=False)]
    if keys:
        try:
            with env.write() as txn:
                delete_chunks(txn, env, keys)  # a meta is never present here; deleting it keeps "whole or absent"
        except lmdb.MapFullError as exc:
            raise storage_error(f"cannot remove unfinished chunks of {env.path}", exc) from exc
        logger.info("disk tier %s: removed the frames of %d chunks left unfinished by a crash", env.path, len(keys))
    return keys


def discard_unfinished(env: DiskEnvironment, keys: Sequence[PrefixKey]) -> None:
    """Best effort after a failed write: delete chunks begun but not ended (else the next open does)."""
    if not keys:
        return
    try:
        with env.write() as txn:
            delete_chunks(txn, env, keys)
    except (StorageError, lmdb.MapFullError) as exc:
        logger.warning("disk writer: %d unfinished chunks stay until the next open removes them (%s)", len(keys), exc)
