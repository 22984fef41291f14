"""What a data dir holds, read from its ``meta`` records: recovery at open, single lookups, batched listing.

The in-memory index is rebuilt from these records at open (``load_stored_chunks``), so a restart serves every
chunk the dir held, in its last LRU order. ``kvstore inspect`` lists them (``iter_stored_chunks``) and shows a
``DiskTierInfo``. A content index rebuilds from ``iter_content_records`` (batches, no object per chunk). Records
that fail their checksum or disagree with the layout are returned separately so a writable tier can delete them;
they are never served.

Every open reads every record (twice with blending on), so the readers decode records in batches
(``disk_format.decode_meta_values``) and hold few lmdb views at a time: thousands of held views made the garbage
collector cost ~5 us per record.

Threads: pure functions over a ``DiskEnvironment``; each opens its own short read transactions, so they run on
any thread and never hold an LMDB snapshot across a ``yield``.
"""

from __future__ import annotations

from collections.abc import Container, Iterator
from dataclasses import dataclass
from pathlib import Path

import lmdb
import numpy as np

from kvstore.keys import PrefixKey
from kvstore.layout import KVLayout
from kvstore.tiers.disk_env import DiskEnvironment
from kvstore.tiers.disk_format import (
    ContentRecords,
    StoredChunk,
    decode_content_records,
    decode_meta,
    decode_meta_values,
)

__all__ = ["DiskTierInfo", "iter_content_records", "iter_stored_chunks", "load_stored_chunks", "read_stored_chunk"]

# Records decoded at once. Held views into the map cost the garbage collector dearly (4096 at a time: 5 us per record,
# 64: nothing measurable), so batches stay small.
_VIEW_BATCH_RECORDS = 64


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


def load_stored_chunks(
    env: DiskEnvironment, layout: KVLayout, chunk_size: int
) -> tuple[list[StoredChunk], list[PrefixKey]]:
    """Every chunk record (tokens left out), and the keys of records unreadable or at odds with the layout.

    The chunks come least recently used first (``DiskIndex.load`` sorts them so; presorted, that sort is one pass).
    """
    chunks: list[StoredChunk] = []
    broken: list[PrefixKey] = []
    bytes_per_token = layout.bytes_per_token  # a property that costs ~1 us: read once, not per chunk
    with env.read() as txn:
        for keys, values in _batches(txn.cursor(db=env.meta_db), _VIEW_BATCH_RECORDS):
            for key, chunk in zip(keys, decode_meta_values(keys, values, with_tokens=False), strict=True):
                if (
                    chunk is not None
                    and 0 < chunk.num_tokens <= chunk_size
                    and chunk.raw_bytes == chunk.num_tokens * bytes_per_token
                    and chunk.frame_bytes > 0
                    and chunk.num_frames == -(-chunk.raw_bytes // chunk.frame_bytes)
                ):
                    chunks.append(chunk)
                else:
                    broken.append(PrefixKey(bytes(key)))
    if chunks:
        last_access = np.fromiter((chunk.last_access_ns for chunk in chunks), dtype=np.uint64, count=len(chunks))
        chunks = [chunks[position] for position in np.argsort(last_access, kind="stable").tolist()]
    return chunks, broken


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
    env: DiskEnvironment, keep: Container[bytes] | None = None, batch_size: int = 1024
) -> Iterator[ContentRecords]:
    """Every readable record's key, parent key, source start and tokens in key order, ``batch_size`` records per
    read transaction (``decode_content_records``); records whose key ``keep`` lacks are left out."""
    resume_at: bytes | None = None  # the first key of the next transaction's batch
    while True:
        with env.read() as txn:
            cursor = txn.cursor(db=env.meta_db)
            if not (cursor.set_range(resume_at) if resume_at is not None else cursor.first()):
                return
            # islice stops on the batch's last record, so the cursor rests there (it moves before each next one)
            batch, num_read = decode_content_records(iter(cursor), batch_size, keep=keep)
            resume_at = bytes(cursor.key()) if num_read == batch_size and cursor.next() else None
        if len(batch):
            yield batch
        if resume_at is None:
            return


def _batches(
    cursor: lmdb.Cursor[memoryview], batch_size: int
) -> Iterator[tuple[list[memoryview], list[memoryview]]]:
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
