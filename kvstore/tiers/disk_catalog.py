"""What a data dir holds, read from its ``meta`` records: recovery at open, single lookups, batched listing.

The in-memory index is rebuilt from these records at open (``load_stored_chunks``), so a restart serves every
chunk the dir held, in its last LRU order. ``kvstore inspect`` lists them (``iter_stored_chunks``) and shows a
``DiskTierInfo``. Records that fail their checksum or disagree with the layout are returned separately so a
writable tier can delete them; they are never served.

Threads: pure functions over a ``DiskEnvironment``; each opens its own short read transactions, so they run on
any thread and never hold an LMDB snapshot across a ``yield``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvstore.keys import PrefixKey
from kvstore.layout import KVLayout
from kvstore.tiers.disk_env import DiskEnvironment
from kvstore.tiers.disk_format import StoredChunk, decode_meta

__all__ = ["DiskTierInfo", "iter_stored_chunks", "load_stored_chunks", "read_stored_chunk"]


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
    """Every chunk record (tokens left out), and the keys of records unreadable or at odds with the layout."""
    chunks: list[StoredChunk] = []
    broken: list[PrefixKey] = []
    with env.read() as txn:
        for key, value in txn.cursor(db=env.meta_db):
            chunk = decode_meta(key, value, with_tokens=False)
            if chunk is not None and _consistent(chunk, layout, chunk_size):
                chunks.append(chunk)
            else:
                broken.append(PrefixKey(bytes(key)))
    return chunks, broken


def _consistent(chunk: StoredChunk, layout: KVLayout, chunk_size: int) -> bool:
    return (
        0 < chunk.num_tokens <= chunk_size
        and chunk.raw_bytes == layout.chunk_bytes(chunk.num_tokens)
        and chunk.frame_bytes > 0
        and chunk.num_frames == -(-chunk.raw_bytes // chunk.frame_bytes)
    )


def read_stored_chunk(env: DiskEnvironment, key: PrefixKey) -> StoredChunk | None:
    """One chunk's record, or ``None`` when it is absent or unreadable."""
    with env.read() as txn:
        value = txn.get(key, db=env.meta_db)
        return None if value is None else decode_meta(key, value)


def iter_stored_chunks(env: DiskEnvironment, batch_size: int = 1024) -> Iterator[StoredChunk]:
    """Every readable chunk record in key order, ``batch_size`` per read transaction."""
    after: bytes | None = None
    while True:
        batch: list[StoredChunk] = []
        with env.read() as txn:
            cursor = txn.cursor(db=env.meta_db)
            found = cursor.set_range(after + b"\x00") if after is not None else cursor.first()
            while found and len(batch) < batch_size:
                chunk = decode_meta(cursor.key(), cursor.value())
                if chunk is not None:
                    batch.append(chunk)
                after = bytes(cursor.key())
                found = cursor.next()
        yield from batch
        if not found:
            return
