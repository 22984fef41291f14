"""The disk tier: chunks in one LMDB environment per data dir, compressed per frame, kept across restarts.

A chunk's KV bytes (``[num_layers, 2, num_tokens, num_kv_heads, head_dim]``, row-major) are cut into frames of
``frame_bytes`` (4 MiB: larger LMDB values write much slower, docs/design-notes.md), each encoded by ``FrameCodec``
(byte-plane shuffle + zstd + checksum) and stored under ``key | frame index``; a meta value per chunk keeps
its sizes, position, last access and tokens (``format``). The parts:

- ``open_disk_parts`` (opening): opens and wires the parts below, recovers the index, closes them in order.
- ``DiskEnvironment`` (environment): the LMDB environment, the owner lock, the layout record, safe map growth.
- ``DiskState`` (state, its values in entries): in-memory LRU of resident chunks, pins, writes in
  flight, counters; rebuilt from the meta records at open (records, decoding a batch of records at a time
  into arrays: meta_batch, meta_checksum), so a reopened data dir serves everything it held. The chunks
  recovered at open stay in arrays until used (recovered): no object per chunk.
- ``DiskWriter`` (writer): one thread, group commit, capacity eviction, lazy last-access persistence.
- ``CodecPool`` (codec_pool): helper threads that encode and decode frames in parallel.

Beyond the ``Tier`` contract: a write in flight is resident (``contains`` is true and ``get_into`` copies it
from its staging or borrowed buffer); ``flush()`` makes everything queued durable; a frame that fails its
checksum is a miss (``corrupt_reads``, a WARNING once per cause) and the chunk is deleted; ``capacity_bytes``
caps stored bytes (compressed frames + meta values; LMDB's B-tree pages and free list live in the map's
headroom, see ``DiskTuning``).

Threads:
- callers, any number: every public method; ``get_into`` fetches frames while the codec helpers decode them.
- ``kvstore-disk-writer``: the only writer of LMDB (see writer).
- ``kvstore-codec-N``: ``num_codec_threads`` helpers shared by readers and the writer.

Locks: ``DiskState._lock`` guards the index and counters; ``_lifecycle`` (an ``OwnedLifecycle``) is held
while a job is queued, so ``close()`` cannot slip between the check and the submit (``close`` drains the
queue); ``_warned_lock`` guards ``_warned``. ``DiskEnvironment._gate`` orders map growth after open read
transactions. The only nesting is ``_lifecycle`` -> the writer's bounded queue (and ``DiskState.admit``
waiting for writes in flight), which the writer drains without taking ``_lifecycle``. The environment
belongs to the opening process: in a forked child every call raises ``StorageError``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

from kvstore.chunking import Chunking
from kvstore.errors import ConfigError, InvalidInputError, StorageError, StoreClosedError
from kvstore.keys import PrefixKey
from kvstore.layout import KVLayout
from kvstore.tiers.base import ChunkRecord, ContentRecords, Tier, TierName, TierStats
from kvstore.tiers.disk.check import DiskCheckReport, check_data_dir
from kvstore.tiers.disk.entries import Admission, PendingWrite
from kvstore.tiers.disk.environment import DiskEnvironment
from kvstore.tiers.disk.lifecycle import OwnedLifecycle
from kvstore.tiers.disk.opening import close_disk_parts, open_disk_parts
from kvstore.tiers.disk.reader import PageDamage, read_chunk
from kvstore.tiers.disk.records import DiskTierInfo, iter_content_records, iter_stored_chunks, read_stored_chunk
from kvstore.tiers.disk.staging import StagingPool
from kvstore.tiers.disk.tuning import DiskTuning
from kvstore.tiers.disk.writer import DeleteJob, WriteJob
from kvstore.tiers.frames.codec import FrameCodec, FrameStatus
from kvstore.tiers.frames.evicted import EvictionSink
from kvstore.tiers.frames.host_copy import copy_tensor
from kvstore.tiers.frames.meta import FrameGeometry, StoredChunk, balanced_frame_bytes
from kvstore.tiers.residency import ResidencyListener

__all__ = ["ContentRecords", "DiskTier", "DiskTierInfo", "DiskTuning", "StoredChunk"]

logger = logging.getLogger(__name__)

_MIB = 1024 * 1024


class DiskTier(Tier):
    """LMDB + zstd chunk storage in one data dir, persistent across restarts.

    Writes are asynchronous: ``flush()`` or ``close()`` makes them durable. The writer is a daemon thread, so
    writes still queued when the interpreter exits without ``close()`` are lost (committed ones are kept).

    Args:
        path: the data dir (created when missing, unless ``read_only``).
        layout: KV layout of every chunk; a data dir keeps the one it was created with.
        chunk_size: tokens per full chunk; a data dir keeps it too.
        capacity_bytes: hard cap on stored (compressed) bytes; must hold one full chunk.
        zstd_level: codec level (1 is the measured sweet spot).
        frame_bytes: raw bytes per frame, a multiple of the element size; default: equal frames of at most
            4 MiB, one per codec thread at least (``balanced_frame_bytes``).
        num_codec_threads: codec helper threads (callers and the writer work too).
        read_only: open without taking ownership (safe next to a live writer in another process); ``put``
            and ``evict`` are refused. ``kvstore inspect`` opens this way.
        clock: ns since the epoch, for last-access times (tests replace it).
        tuning: rarely changed knobs.
        content_records: called during the open, before this returns, with the content records of every chunk
            the data dir holds (a batch at a time, in key order; ``iter_content_records`` has the same batches):
            a content index (``ContentCatalog.start_rebuild().add``) then rebuilds from the tier's own pass over
            the meta records instead of a second one. Chunks evicted at once because ``capacity_bytes`` shrank
            since the last open are included. An exception it raises aborts the open.
        on_evict: called on the writer thread with each batch of chunks evicted for room, their stored bytes
            read just before the delete (``kvstore.tiers.disk.victim_reads``): how the remote tier's ``evict`` policy
            receives what leaves the disk. It must only queue work.
        chunking: the store's cut rule: a fresh data dir records it, a writable open of a dir cut by another rule
            is refused (read-only opens read chunks whatever their cut).

    Raises:
        ConfigError: a size is out of range.
        LayoutMismatchError: the data dir holds another layout or chunk size, or was cut by another rule.
        StorageError: the data dir cannot be opened, or another process holds it.
    """

    name = TierName.DISK

    def __init__(
        self,
        path: Path,
        layout: KVLayout,
        chunk_size: int,
        capacity_bytes: int,
        *,
        zstd_level: int = 1,
        frame_bytes: int | None = None,
        num_codec_threads: int = 2,
        read_only: bool = False,
        clock: Callable[[], int] = time.time_ns,
        tuning: DiskTuning | None = None,
        content_records: Callable[[ContentRecords], None] | None = None,
        on_evict: EvictionSink | None = None,
        chunking: Chunking = Chunking.FIXED,
    ) -> None:
        tuning = tuning or DiskTuning()
        self.path = Path(path)
        self.layout = layout
        self.chunk_size = chunk_size
        self.capacity_bytes = capacity_bytes
        self.read_only = read_only
        self.frame_bytes = frame_bytes or balanced_frame_bytes(
            layout.chunk_bytes(chunk_size), layout.dtype.element_size_bytes, num_codec_threads
        )
        self._codec = FrameCodec(layout.dtype.element_size_bytes, zstd_level=zstd_level)
        self._geometry = FrameGeometry(
            layout=layout,
            chunk_size=chunk_size,
            frame_bytes=self.frame_bytes,
            frame_header_bytes=self._codec.header_bytes,
        )
        self._clock = clock
        if not read_only and capacity_bytes < self._geometry.stored_bound_bytes(chunk_size):
            raise ConfigError(
                f"disk tier capacity_bytes={capacity_bytes} is below one chunk "
                f"({self._geometry.stored_bound_bytes(chunk_size) / _MIB:.1f} MiB for {layout.describe()} x "
                f"{chunk_size} tokens); raise it (StoreConfig.disk_capacity_bytes, kvstore serve --disk-size)"
            )
        self._lifecycle = OwnedLifecycle(f"disk tier {self.path}")
        self._warned_lock = threading.Lock()
        self._warned: set[str] = set()
        chunk_bytes = layout.chunk_bytes(chunk_size)
        self._staging = StagingPool(  # before the data dir opens: a failed allocation leaves nothing open
            chunk_bytes,
            max(2, min(64, tuning.staging_bytes // chunk_bytes)),
            preallocate=tuning.preallocate_staging and not read_only,
        )
        parts = open_disk_parts(
            self.path,
            geometry=self._geometry,
            codec=self._codec,
            capacity_bytes=capacity_bytes,
            num_codec_threads=num_codec_threads,
            read_only=read_only,
            tuning=tuning,
            content_records=content_records,
            on_evict=on_evict,
            chunking=chunking,
        )
        self._parts = parts
        self._env, self._index, self._pool, self._writer = parts.env, parts.index, parts.pool, parts.writer

    @classmethod
    def open_existing(cls, path: Path, *, read_only: bool = True, num_codec_threads: int = 2) -> DiskTier:
        """Open a data dir with the layout, chunk size and capacity it records (``kvstore inspect``)."""
        env = DiskEnvironment(Path(path), read_only=True, map_size_bytes=64 * _MIB)
        try:
            info = env.read_info()
        finally:
            env.close()
        if info is None:
            raise StorageError(f"data dir {path} is empty (no layout recorded); nothing to open")
        capacity_bytes = info.capacity_bytes or 0
        return cls(
            path,
            info.layout,
            info.chunk_size,
            capacity_bytes,
            read_only=read_only,
            num_codec_threads=num_codec_threads,
        )

    # -- queries ---------------------------------------------------------------------------------------------

    def contains(self, key: PrefixKey) -> bool:
        self._check_usable()
        return self._index.contains(key)

    def num_tokens(self, key: PrefixKey) -> int | None:
        self._check_usable()
        return self._index.num_tokens(key)

    def record(self, key: PrefixKey) -> ChunkRecord | None:
        """The chunk's key, position and tokens (from its meta record); ``None`` when it is not resident."""
        self._check_usable()
        pending = self._index.pending_record(key)
        if pending is not None or not self._index.contains(key):
            return pending
        chunk = read_stored_chunk(self._env, key)
        if chunk is None:
            return None
        return ChunkRecord(key=key, source_start=chunk.source_start, tokens=chunk.tokens, parent_key=chunk.parent_key)

    def keys(self) -> list[PrefixKey]:
        self._check_usable()
        return self._index.keys()

    def stats(self) -> TierStats:
        return self._index.stats()

    def check(self, progress: Callable[[int], None] | None = None) -> DiskCheckReport:
        """Walk every chunk and frame of the data dir and report every defect (``check``); read-only."""
        self._check_usable()
        return check_data_dir(self._env, self._codec, progress)

    def describe(self) -> DiskTierInfo:
        """Sizes, access range and settings of the data dir, for ``kvstore inspect``."""
        self._check_usable()
        stats = self._index.stats()
        oldest_ns, newest_ns = self._index.access_range_ns()
        return DiskTierInfo(
            path=self.path,
            layout=self.layout,
            chunk_size=self.chunk_size,
            capacity_bytes=self.capacity_bytes,
            read_only=self.read_only,
            num_chunks=stats.num_chunks,
            num_pending=self._index.num_pending(),
            used_bytes=stats.used_bytes,
            stored_bytes=stats.stored_bytes,
            oldest_access_ns=oldest_ns,
            newest_access_ns=newest_ns,
            map_size_bytes=self._env.map_size_bytes,
            file_bytes=self._env.file_bytes(),
            frame_bytes=self.frame_bytes,
            write_errors=self._index.counters().write_errors,
        )

    def iter_records(self, batch_size: int = 256) -> Iterator[StoredChunk]:
        """Every committed chunk in key order with its metadata and tokens (``flush`` first for pending ones).

        Records are read ``batch_size`` per read transaction, so a slow consumer holds no LMDB snapshot;
        last-access times include hits not yet persisted. Small batches also keep the garbage collector quiet: a
        batch of a few hundred chunks is freed before it triggers a collection, where 1024 pushed chunks into the
        oldest generation and cost full collections (measured: docs/design-notes.md#tiers-disk-tier).
        """
        self._check_usable()
        last_access_of = self._index.last_access_ns
        for chunk in iter_stored_chunks(self._env, batch_size):
            last_access_ns = last_access_of(chunk.key)
            if last_access_ns is None:  # evicted since
                continue
            if last_access_ns > chunk.last_access_ns:  # a hit not yet persisted (a copy is not free: only then)
                chunk = dataclasses.replace(chunk, last_access_ns=last_access_ns)
            yield chunk

    def watch(self, listener: ResidencyListener) -> None:
        self._index.watch(listener)

    def resident_batches(self) -> Iterator[ContentRecords]:
        """The chunks admitted and not yet committed, then every committed one from its meta record (a batch at a
        time, as a content index rebuilds)."""
        self._check_usable()
        pending = self._index.pending_records()
        if pending:
            yield ContentRecords.of(pending)
        yield from self.iter_content_records()

    def iter_content_records(self, batch_size: int = 1024) -> Iterator[ContentRecords]:
        """The key, parent key, source start and tokens of every committed chunk, in key order, in batches of up to
        ``batch_size`` chunks with no object per chunk: what a content index rebuilds from at open. Records are
        decoded a batch at a time into arrays (``meta_batch``), several times faster than ``iter_records``.

        Each batch is read in its own read transaction, and which of its chunks are resident is asked once per batch:
        a chunk evicted after its batch was read may still be yielded.
        """
        self._check_usable()
        return iter_content_records(self._env, self._index.resident_mask, batch_size)

    # -- writes ----------------------------------------------------------------------------------------------

    def put(self, record: ChunkRecord, kv: torch.Tensor) -> bool:
        """Copy ``kv`` (any device, any strides) into a staging buffer and queue its write.

        Blocks while every staging buffer is in flight, or while writes in flight fill the capacity. Returns
        ``False`` only when pinned chunks leave no room for this one.
        """
        self._check_writable()
        self._check_chunk(record, kv)
        if self._index.contains(record.key):
            return True
        buffer = self._staging.acquire()
        staged = buffer[: self.layout.chunk_bytes(record.num_tokens)]
        try:
            copy_tensor(staged.view(self.layout.dtype.torch_dtype).view(kv.shape), kv)
        except BaseException:
            self._staging.release(buffer)
            raise
        return self._enqueue(record, staged.numpy(), functools.partial(self._staging.release, buffer))

    def put_borrowed(self, record: ChunkRecord, kv: torch.Tensor, on_done: Callable[[], None]) -> bool:
        """Queue a chunk without copying it: the writer reads ``kv`` in place.

        ``on_done`` is called exactly once whatever happens -- after the commit, after a failed or rejected
        write, at once when the chunk is already resident, or before this method raises -- and from then on
        the tier no longer touches ``kv``. It may run on the writer thread: keep it short, and never call
        ``put``/``put_borrowed`` from it.

        Args:
            record: the chunk's key, position and tokens.
            kv: a contiguous cpu tensor of the layout, left unchanged until ``on_done``.
            on_done: releases ``kv`` (e.g. unpins the cpu slot it lives in).
        """
        handed_over = False
        try:
            self._check_writable()
            self._check_chunk(record, kv)
            if kv.device.type != "cpu" or not kv.is_contiguous():
                raise InvalidInputError(
                    f"put_borrowed needs a contiguous cpu tensor, got one on {kv.device} "
                    f"(contiguous={kv.is_contiguous()}); use put() to copy it"
                )
            data = kv.detach().reshape(-1).view(torch.uint8).numpy()
            handed_over = True
            return self._enqueue(record, data, on_done)
        finally:
            if not handed_over:
                on_done()

    def _enqueue(self, record: ChunkRecord, data: npt.NDArray[np.uint8], release: Callable[[], None]) -> bool:
        """Admit a chunk and queue its write; ``release`` is called at once unless the write was queued."""
        pending = PendingWrite(record=record, data=data)
        admission: Admission | None = None
        try:
            with self._lifecycle.while_open():
                bound_bytes = self._geometry.stored_bound_bytes(record.num_tokens)
                admission = self._index.admit(
                    pending, raw_bytes=data.shape[0], stored_bound_bytes=bound_bytes, now_ns=self._clock()
                )
                if admission is Admission.ADMITTED:
                    assert self._writer is not None, "DiskTier._enqueue on a read-only tier: _check_writable missed"
                    self._writer.submit(WriteJob(pending=pending, release=release))
        finally:
            if admission is not Admission.ADMITTED:
                release()
        if admission is Admission.NO_ROOM:
            self._warn_once("no-room", "disk tier %s: put rejected, pinned chunks fill the capacity", self.path)
            return False
        return True

    def flush(self) -> None:
        """Block until everything queued is committed (or dropped and counted) and synced to disk."""
        self._check_usable()
        if self._writer is not None:
            self._writer.flush()

    # -- reads -----------------------------------------------------------------------------------------------

    def get_into(self, key: PrefixKey, out: torch.Tensor) -> bool:
        """Decode a chunk into ``out``, a contiguous cpu tensor of the chunk's exact byte size (any dtype).

        Returns:
            ``False`` on a miss, when the chunk vanished meanwhile, or when it failed its checksum (then it is
            counted in ``corrupt_reads``, logged and deleted; ``out`` holds garbage). Never wrong bytes.

        Raises:
            InvalidInputError: ``out`` is not a contiguous cpu tensor of the chunk's size.
        """
        self._check_usable()
        if not isinstance(out, torch.Tensor) or out.device.type != "cpu" or not out.is_contiguous():
            raise InvalidInputError("get_into needs a contiguous cpu tensor (any dtype) of the chunk's byte size")
        out_bytes = out.detach().reshape(-1).view(torch.uint8).numpy()
        ticket = self._index.begin_read(key, self._clock())
        if ticket is None:
            return False
        if out_bytes.shape[0] != ticket.raw_bytes:
            if ticket.pending is not None:
                self._index.end_pending_read(ticket.pending)
            raise InvalidInputError(
                f"out holds {out_bytes.shape[0]} bytes but chunk {key.hex()} holds {ticket.raw_bytes}; pass "
                "a tensor of the layout's chunk_shape(num_tokens(key))"
            )
        if ticket.pending is not None:  # read-your-writes: copy from the bytes being written
            try:
                np.copyto(out_bytes, ticket.pending.data)
            finally:
                self._index.end_pending_read(ticket.pending)
            status: FrameStatus | None = FrameStatus.OK
        else:
            read = read_chunk(self._env, self._codec, self._pool, key, ticket.frame_bytes, out_bytes)
            if isinstance(read, PageDamage):
                self._count_damaged(key, read)
                return False
            status = read
        if status is FrameStatus.OK:
            return True
        if status is None:
            return False
        self._drop_corrupt(key, status)
        return False

    def _count_damaged(self, key: PrefixKey, damage: PageDamage) -> None:
        """A chunk behind a damaged LMDB page: a counted miss, like a frame that fails its checksum.

        It stays indexed and in LMDB, unlike a corrupt frame: deleting it, or writing a new copy over it once the
        index forgot it, walks the same damaged page and fails the writer's whole group, honest chunks included.
        Kept, it is only read (and counted) again; ``kvstore inspect --check`` reports the damage.
        """
        self._index.count_corrupt_read()
        self._warn_once(
            "corrupt-page",
            "disk tier %s: chunk %s lies behind a damaged LMDB page (%s); counted as a miss (later ones are only "
            "counted, in corrupt_reads)",
            self.path, key.hex(), damage.reason,
        )  # fmt: skip

    def _drop_corrupt(self, key: PrefixKey, status: FrameStatus) -> None:
        self._index.count_corrupt_read()
        self._warn_once(
            f"corrupt-{status.value}",
            "disk tier %s: chunk %s failed to decode (%s); dropped and counted as a miss (later drops for "
            "this cause are only counted, in corrupt_reads)",
            self.path, key.hex(), status.value,
        )  # fmt: skip
        if self._index.drop(key) and self._writer is not None:
            with contextlib.suppress(StoreClosedError), self._lifecycle.while_open():
                self._writer.submit(DeleteJob((key,)))

    # -- pins and eviction -----------------------------------------------------------------------------------

    def pin(self, key: PrefixKey) -> bool:
        self._check_usable()
        return self._index.pin(key)

    def unpin(self, key: PrefixKey) -> None:
        """Undo one ``pin``; a no-op when the chunk is gone (dropped as corrupt) or not pinned."""
        self._check_usable()
        self._index.unpin(key)

    def evict(self, key: PrefixKey) -> bool:
        self._check_writable()
        if not self._index.evict(key):
            return False
        self._submit_delete([key])
        return True

    def evict_bytes(self, num_bytes: int) -> int:
        """Drop least recently used unpinned chunks until ``num_bytes`` stored bytes are freed."""
        self._check_writable()
        victims, freed_bytes = self._index.take_victims(num_bytes)
        self._submit_delete(victims)
        return freed_bytes

    def _submit_delete(self, keys: list[PrefixKey]) -> None:
        if keys:
            with self._lifecycle.while_open():
                assert self._writer is not None, "DiskTier delete on a read-only tier: _check_writable missed"
                self._writer.submit(DeleteJob(tuple(keys)))

    # -- lifecycle -------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Commit everything queued, persist access times, sync, stop the threads, close LMDB. Idempotent.

        In a forked child it only marks the tier closed: the environment and threads belong to the parent.
        """
        if not self._lifecycle.close():
            return
        close_disk_parts(self._parts)
        logger.info("disk tier %s closed", self.path)

    def _check_usable(self) -> None:
        self._lifecycle.check()

    def _check_writable(self) -> None:
        self._check_usable()
        if self.read_only:
            raise StorageError(
                f"disk tier {self.path} was opened read-only and cannot put or evict; open it writable "
                "(after stopping the process that holds it)"
            )

    def _check_chunk(self, record: ChunkRecord, kv: torch.Tensor) -> None:
        if not 0 < record.num_tokens <= self.chunk_size:
            raise InvalidInputError(
                f"chunk of {record.num_tokens} tokens: a chunk holds 1..chunk_size={self.chunk_size} tokens"
            )
        self.layout.check_kv(kv, record.num_tokens)

    def _warn_once(self, cause: str, message: str, *args: object) -> None:
        with self._warned_lock:
            if cause in self._warned:
                return
            self._warned.add(cause)
        logger.warning(message, *args)
