"""Opening a data dir: the LMDB environment, the layout check, index recovery, the codec pool and the writer.

``open_disk_parts`` wires the disk tier's parts in dependency order and unwinds what it opened when a step
fails; ``close_disk_parts`` drains the writer (every queued write commits, access times persist, the file is
synced) before it stops the codec helpers and closes the environment. Recovery (writable opens) first deletes
the frames of chunks a crash left unfinished (their intent records, commit), then rebuilds the in-memory
index from the meta records (a restart keeps every chunk and its LRU order); records that are unreadable, and
chunks over a capacity that shrank since the last open, are queued for deletion.

Threads: runs on the thread that opens or closes the tier; starts the writer and the codec helpers. The cyclic
garbage collector is paused (process-wide) while recovery reads the meta records, and restored after.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvstore.chunking import Chunking
from kvstore.collector import collector_paused
from kvstore.keys import PrefixKey
from kvstore.tiers.base import ContentRecords
from kvstore.tiers.disk.commit import remove_unfinished_chunks
from kvstore.tiers.disk.environment import DiskEnvironment, tune_malloc_for_large_values
from kvstore.tiers.disk.layout_copy import keep_layout_copy
from kvstore.tiers.disk.records import recover_chunks
from kvstore.tiers.disk.state import DiskState
from kvstore.tiers.disk.tuning import DiskTuning
from kvstore.tiers.disk.writer import DeleteJob, DiskWriter, WriterOptions
from kvstore.tiers.frames.codec import FrameCodec
from kvstore.tiers.frames.codec_pool import CodecPool
from kvstore.tiers.frames.evicted import EvictionSink
from kvstore.tiers.frames.meta import FrameGeometry

__all__ = ["DiskParts", "close_disk_parts", "open_disk_parts"]

logger = logging.getLogger(__name__)

_MIB = 1024 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class DiskParts:
    """The opened parts of a disk tier; ``writer`` is ``None`` when read-only."""

    env: DiskEnvironment
    index: DiskState
    pool: CodecPool
    writer: DiskWriter | None


def open_disk_parts(
    path: Path,
    *,
    geometry: FrameGeometry,
    codec: FrameCodec,
    capacity_bytes: int,
    num_codec_threads: int,
    read_only: bool,
    tuning: DiskTuning,
    content_records: Callable[[ContentRecords], None] | None = None,
    on_evict: EvictionSink | None = None,
    chunking: Chunking = Chunking.FIXED,
) -> DiskParts:
    """Open (or create) a data dir and start its threads; ``content_records`` is fed recovery's content records
    (``recover_chunks``), ``on_evict`` the writer's capacity victims (``evicted``).

    Raises:
        LayoutMismatchError: the dir holds another layout or chunk size, or (writable) was cut by another rule.
        StorageError: the dir cannot be opened or is held by another writer.
    """
    env = DiskEnvironment(
        path,
        read_only=read_only,
        map_size_bytes=tuning.initial_map_bytes(capacity_bytes),
        max_readers=tuning.max_readers,
    )
    try:
        try:
            env.check_info(geometry.layout, geometry.chunk_size, capacity_bytes, chunking)
        finally:
            if not read_only:  # what the next start reads first; repaired even when this open is refused
                keep_layout_copy(env)
        index = DiskState(capacity_bytes)
        if not read_only:
            remove_unfinished_chunks(env)
        broken = _recover(env, index, geometry, read_only, content_records)
        pool = CodecPool(num_codec_threads)
    except BaseException:
        env.close()
        raise
    if read_only:
        return DiskParts(env=env, index=index, pool=pool, writer=None)
    if tuning.tune_malloc and tune_malloc_for_large_values():
        logger.info("disk tier: glibc malloc thresholds raised for multi-MiB LMDB values")
    options = WriterOptions(
        frame_bytes=geometry.frame_bytes,
        max_group_bytes=tuning.max_group_bytes,
        max_transaction_bytes=tuning.max_transaction_bytes,
        max_map_bytes=tuning.map_limit_bytes(capacity_bytes),
        queue_depth=tuning.queue_depth,
        writeback_bytes=tuning.writeback_bytes,
        on_evict=on_evict,
    )
    writer = DiskWriter(env, codec, index, pool, options)
    victims, _ = index.take_victims(index.overflow_bytes(0))  # the capacity may have shrunk since last time
    if broken or victims:
        writer.submit(DeleteJob(tuple(broken + victims)))
    return DiskParts(env=env, index=index, pool=pool, writer=writer)


def close_disk_parts(parts: DiskParts) -> None:
    """Drain and stop the writer, then stop the codec helpers and close the environment (in that order)."""
    try:
        if parts.writer is not None:
            parts.writer.stop()
    finally:
        parts.pool.close()
        parts.env.close()


def _recover(
    env: DiskEnvironment,
    index: DiskState,
    geometry: FrameGeometry,
    read_only: bool,
    content_records: Callable[[ContentRecords], None] | None,
) -> list[PrefixKey]:
    """Rebuild the index from the meta records; returns the keys of broken records."""
    started_s = time.perf_counter()
    with collector_paused():
        recovery = recover_chunks(env, geometry.layout, geometry.chunk_size, content_records)
        index.load(recovery.chunks)
    broken = recovery.broken_keys
    if broken:
        logger.warning("disk tier %s: %d chunks with unreadable metadata dropped", env.path, len(broken))
    stats = index.stats()
    logger.info(
        "disk tier %s: recovered %d chunks (%.1f MiB stored, %.1f MiB raw) in %.2f s%s",
        env.path, stats.num_chunks, stats.stored_bytes / _MIB, stats.used_bytes / _MIB,
        time.perf_counter() - started_s, " (read-only)" if read_only else "",
    )  # fmt: skip
    return broken
