"""What a data dir holds, read from its ``meta`` records: recovery at open, single lookups, batched listing.

The in-memory index is rebuilt from these records at open (``recover_chunks``), so a restart serves every chunk
the dir held, in its last LRU order. ``kvstore inspect`` lists them (``iter_stored_chunks``) and shows a
``DiskTierInfo``. A content index rebuilds from ``iter_content_records`` (batches, no object per chunk). Records
that fail their checksum or disagree with the layout are returned separately so a writable tier can delete them;
they are never served.

Every open reads every record (twice with blending on: a million records each for 1M chunks), so recovery and the
content records decode a batch of records at a time into arrays (``meta_batch``: no Python per record but
the cursor's own step); ``iter_stored_chunks``, which builds a ``StoredChunk`` per record anyway, decodes with
``format.decode_meta_values``.

Threads: pure functions over a ``DiskEnvironment``; each opens its own short read transactions, so they run on
any thread and never hold an LMDB snapshot across a ``yield``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import lmdb
import numpy as np
import numpy.typing as npt

from kvstore.keys import PrefixKey
from kvstore.layout import KVLayout
from kvstore.tiers.base import ContentRecords
from kvstore.tiers.disk.environment import DiskEnvironment
from kvstore.tiers.disk.meta_batch import MetaBatch, read_meta_batches
from kvstore.tiers.disk.recovered import RecoveredChunks
from kvstore.tiers.frames.meta import StoredChunk, decode_meta, decode_meta_values

__all__ = ["DiskTierInfo", "Recovery", "iter_content_records", "iter_stored_chunks", "read_stored_chunk",
           "recover_chunks"]  # fmt: skip

# Records decoded into StoredChunks at once. Held views into the map cost the garbage collector dearly when thousands
# are held at a time with a million index objects alive (measured: docs/design-notes.md#tiers-disk-records), so these
# batches stay small.
_VIEW_BATCH_RECORDS = 64
# Records decoded into arrays at once (``MetaBatch``): enough to spread numpy's per-call cost thin, few enough
# that the views held until the batch is copied stay cheap.
_ARRAY_BATCH_RECORDS = 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class DiskTierInfo:
    """A data dir at a glance (``DiskTier.describe``, shown by ``kvstore inspect``).

    Args:
        path: the data dir.
        layout: KV layout the dir was created with.
        chunk_size: tokens per full chunk.
        capacity_bytes: cap on stored bytes (as last opened).
        read_only: whether this tier was opened read-only.
        num_chunks: resident chunks, writes in flight included.
        num_pending: writes queued or being committed.
        used_bytes: uncompressed KV bytes of resident chunks.
        stored_bytes: bytes the committed chunks occupy (frames + meta values).
        oldest_access_ns: oldest last access of a resident chunk (ns since the epoch), ``None`` when empty.
        newest_access_ns: newest last access.
        map_size_bytes: the LMDB map (address space; the file grows as data is written).
        file_bytes: size of ``data.mdb``.
        frame_bytes: raw bytes per frame for new writes.
        write_errors: writes dropped because the writer failed (logged).
    """

    path: Path
    layout: KVLayout
    chunk_size: int
    capacity_bytes: int
    read_only: bool
    num_chunks: int
    num_pending: int
    used_bytes: int
    stored_bytes: int
    oldest_access_ns: int | None
    newest_access_ns: int | None
    map_size_bytes: int
    file_bytes: int
    frame_bytes: int
    write_errors: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Recovery:
    """What recovery read from the meta records: the chunks to index, and the keys of records to delete.

    Args:
        chunks: readable records that agree with the layout and chunk size.
        broken_keys: records unreadable (``decode_meta`` refuses them) or at odds with the layout.
    """

    chunks: RecoveredChunks
    broken_keys: list[PrefixKey]


def recover_chunks(
    env: DiskEnvironment,
    layout: KVLayout,
    chunk_size: int,
    content_records: Callable[[ContentRecords], None] | None = None,
) -> Recovery:
    """Every chunk record's sizes and last access, in key order, and the broken records' keys.

    Args:
        content_records: also called with the content records of the chunks recovered, a batch at a time, so a
            content index can rebuild from this pass instead of reading every record again.
    """
    parts: list[RecoveredChunks] = []
    broken: list[PrefixKey] = []
    bytes_per_token = layout.bytes_per_token
    with env.read_copies() as txn:
        for batch in read_meta_batches(iter(txn.cursor(db=env.meta_db)), _ARRAY_BATCH_RECORDS):
            broken += batch.broken_keys
            consistent = (
                (batch.num_tokens > 0)
                & (batch.num_tokens <= chunk_size)
                & (batch.raw_bytes == batch.num_tokens * bytes_per_token)
                & (batch.frame_bytes > 0)
                & (batch.num_frames == -(-batch.raw_bytes // np.maximum(batch.frame_bytes, 1)))
            )
            parts.append(_recovered(batch, consistent))
            if content_records is not None and consistent.any():
                content_records(batch.content(consistent))
            if not consistent.all():
                broken += [key for key, keep in zip(batch.keys, consistent.tolist(), strict=True) if not keep]
    return Recovery(chunks=RecoveredChunks.concatenate(parts), broken_keys=broken)


def _recovered(batch: MetaBatch, keep: npt.NDArray[np.bool_]) -> RecoveredChunks:
    all_kept = bool(keep.all())
    return RecoveredChunks(
        keys=batch.keys if all_kept else [key for key, kept in zip(batch.keys, keep.tolist(), strict=True) if kept],
        num_tokens=batch.num_tokens[keep],
        raw_bytes=batch.raw_bytes[keep],
        stored_bytes=batch.stored_bytes[keep],
        num_frames=batch.num_frames[keep],
        frame_bytes=batch.frame_bytes[keep],
        last_access_ns=batch.last_access_ns[keep],
    )


def read_stored_chunk(env: DiskEnvironment, key: PrefixKey) -> StoredChunk | None:
    """One chunk's record, or ``None`` when it is absent or unreadable."""
    with env.read() as txn:
        value = txn.get(key, db=env.meta_db)
        return None if value is None else decode_meta(key, value)


def iter_stored_chunks(env: DiskEnvironment, batch_size: int = 256) -> Iterator[StoredChunk]:
    """Every readable chunk record in key order, ``batch_size`` per read transaction."""
    resume_at: bytes | None = None  # the first key of the next transaction's batch
    while True:
        batch: list[StoredChunk] = []
        with env.read() as txn:
            cursor = txn.cursor(db=env.meta_db)
            found = cursor.set_range(resume_at) if resume_at is not None else cursor.first()
            resume_at = None
            if found:
                for keys, values in _batches(cursor, min(batch_size, _VIEW_BATCH_RECORDS)):
                    batch += [chunk for chunk in decode_meta_values(keys, values) if chunk is not None]
                    if len(batch) >= batch_size:
                        resume_at = bytes(cursor.key()) if cursor.next() else None
                        break
        yield from batch
        if resume_at is None:
            return


def iter_content_records(
    env: DiskEnvironment,
    resident_mask: Callable[[list[PrefixKey]], npt.NDArray[np.bool_]] | None = None,
    batch_size: int = _ARRAY_BATCH_RECORDS,
) -> Iterator[ContentRecords]:
    """Every readable record's key, parent key, source start and tokens in key order, ``batch_size`` records per
    read transaction; records that ``resident_mask`` says are not resident are left out."""
    resume_at: bytes | None = None  # the first key of the next transaction's batch
    while True:
        with env.read_copies() as txn:
            cursor = txn.cursor(db=env.meta_db)
            if not (cursor.set_range(resume_at) if resume_at is not None else cursor.first()):
                return
            # islice stops on the batch's last record, so the cursor rests there (it moves before each next one)
            batch = next(read_meta_batches(iter(cursor), batch_size), None)
            if batch is None:
                return
            num_read = len(batch) + len(batch.broken_keys)
            resume_at = bytes(cursor.key()) if num_read == batch_size and cursor.next() else None
        content = _content_records(batch, resident_mask)
        if len(content):
            yield content
        if resume_at is None:
            return


def _content_records(
    batch: MetaBatch, resident_mask: Callable[[list[PrefixKey]], npt.NDArray[np.bool_]] | None
) -> ContentRecords:
    return batch.content(None if resident_mask is None else resident_mask(batch.keys))


def _batches(cursor: lmdb.Cursor[memoryview], batch_size: int) -> Iterator[tuple[list[memoryview], list[memoryview]]]:
    """The records from the cursor's position on, ``batch_size`` keys and values at a time: views into the map,
    valid until the transaction ends. The cursor rests on the last record of each batch."""
    keys: list[memoryview] = []
    values: list[memoryview] = []
    for key, value in cursor:  # iterates from the cursor's position
        keys.append(key)
        values.append(value)
        if len(keys) == batch_size:
            yield keys, values
            keys, values = [], []
    if keys:
        yield keys, values
