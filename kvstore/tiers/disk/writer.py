"""The disk tier's one writer thread: group commit of queued writes, deletes, access times and syncs.

The thread takes every job waiting (up to ``max_group_bytes`` of KV) as a group and starts encoding the group's
frames on the codec pool at once, into one of two reusable arenas (no per-frame allocation). While the helpers
encode group ``N + 1``, the thread completes group ``N``:

1. waits for its frames (encoding any the helpers have not started);
2. picks LRU victims so that stored bytes + the group's stored bytes stay under the cap (pinned and pending
   chunks are never victims; writes that still do not fit are rejected and counted);
3. commits one transaction deleting victims and evicted/corrupt chunks and persisting changed last-access
   times (its freed pages are reusable by the next transaction);
4. commits the group's frames in short transactions of at most ``max_transaction_bytes`` each, every chunk's
   meta in the transaction of its last frame, with an intent record while a chunk spans several (commit:
   one multi-MiB value per transaction costs LMDB a fraction of many); on ``MapFullError`` a transaction
   grows the map (up to ``max_map_bytes``), else evicts more, and is retried; if one still fails, the chunks
   it had begun are deleted (or left to the next open) and the group's uncommitted writes are dropped;
5. updates the index (the chunks stop being pending), waits for readers copying out of their pending bytes,
   and releases each write's buffer (``release`` is called exactly once per write, whatever happened);
6. syncs when the group holds a flush or the stop job (then wakes the flushers), or else starts the disk's
   writeback every ``writeback_bytes`` so a later sync waits only for the tail.

A failure in a group (an lmdb error, a full map that cannot grow) never ends the thread: it is logged with
``logger.exception``, the group's uncommitted writes are counted in ``write_errors`` and dropped, their
buffers released; chunks whose meta committed before the failure stay committed. Failures on a full filesystem
are logged once per outage instead, without a traceback (``outage``).

Threads: the writer thread owns ``_arenas``, ``_arena_turn``, ``_unwritten_bytes`` and every write
transaction. Callers only touch the bounded ``_queue`` (a full queue blocks them: backpressure).
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import lmdb
import numpy as np
import numpy.typing as npt

from kvstore.errors import StorageError
from kvstore.keys import PrefixKey
from kvstore.tiers.disk.commit import ChunkFrames, delete_chunks, discard_unfinished, plan_transactions
from kvstore.tiers.disk.entries import PendingWrite
from kvstore.tiers.disk.environment import DiskEnvironment, storage_error
from kvstore.tiers.disk.outage import DiskOutage
from kvstore.tiers.disk.state import DiskState
from kvstore.tiers.disk.victim_reads import read_evicted
from kvstore.tiers.frames.codec import FrameCodec
from kvstore.tiers.frames.codec_pool import CodecPool, TaskBatch
from kvstore.tiers.frames.evicted import EvictionSink
from kvstore.tiers.frames.meta import StoredChunk, encode_meta, meta_bytes, with_last_access

__all__ = ["DeleteJob", "DiskWriter", "FlushJob", "WriteJob", "WriterOptions"]

logger = logging.getLogger(__name__)

_MAX_COMMIT_ATTEMPTS = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteJob:
    """Write one pending chunk; ``release`` hands its bytes back (staging buffer or ``on_done``)."""

    pending: PendingWrite
    release: Callable[[], None]


@dataclass(frozen=True, slots=True)
class DeleteJob:
    """Delete chunks already removed from the index (evicted, or failed their checksum)."""

    keys: tuple[PrefixKey, ...]


@dataclass(frozen=True, slots=True)
class FlushJob:
    """Set ``done`` once every job queued before it is committed (or dropped) and synced."""

    done: threading.Event


@dataclass(frozen=True, slots=True)
class _StopJob:
    """Drain, persist, sync and end the thread."""


_Job = WriteJob | DeleteJob | FlushJob | _StopJob


@dataclass(frozen=True, slots=True, kw_only=True)
class WriterOptions:
    """Settings of the writer thread.

    Args:
        frame_bytes: raw bytes per frame (a multiple of the element size).
        max_group_bytes: raw KV bytes one group commit takes at most (a larger single write goes alone).
        max_transaction_bytes: encoded frame bytes one write transaction holds at most (at least one frame).
        max_map_bytes: the LMDB map never grows past this.
        queue_depth: jobs waiting before ``submit`` blocks.
        writeback_bytes: start the disk's writeback (without waiting) after this many stored bytes were
            committed, so it writes while the next groups encode and a ``flush`` waits only for the tail
            (0: the disk writes at the next ``flush``).
        on_evict: receives the capacity victims' stored bytes before they are deleted (``evicted``).
    """

    frame_bytes: int
    max_group_bytes: int
    max_transaction_bytes: int
    max_map_bytes: int
    queue_depth: int
    writeback_bytes: int
    on_evict: EvictionSink | None = None


@dataclass(slots=True)
class _Encoded:
    """One write of a group: where its encoded frames lie in the group's arena."""

    job: WriteJob
    frame_spans: list[tuple[int, int]]  # (offset, length) in the arena
    stored_bytes: int


_FrameSpan = tuple[_Encoded, npt.NDArray[np.uint8], int, int]
"""A frame to encode: its chunk, its raw bytes, its offset in the arena and the bytes reserved there."""


@dataclass(slots=True)
class _Group:
    """Jobs committed together; ``lengths`` yields each frame's encoded length once encoding finished."""

    jobs: list[_Job]
    writes: list[WriteJob]
    encoded: list[_Encoded]
    lengths: TaskBatch[int]
    arena: npt.NDArray[np.uint8] = field(default_factory=lambda: np.empty(0, dtype=np.uint8))
    error: Exception | None = None

    @property
    def stops(self) -> bool:
        return any(isinstance(job, _StopJob) for job in self.jobs)


class DiskWriter:
    """Owns the writer thread and its queue; see the module docstring for one loop."""

    def __init__(
        self,
        env: DiskEnvironment,
        codec: FrameCodec,
        index: DiskState,
        pool: CodecPool,
        options: WriterOptions,
    ) -> None:
        self._outage = DiskOutage(env.path, env.file_bytes, index.capacity_bytes)
        self._env = env
        self._codec = codec
        self._index = index
        self._pool = pool
        self._options = options
        self._queue: queue.Queue[_Job] = queue.Queue(maxsize=options.queue_depth)
        self._arenas = [np.empty(0, dtype=np.uint8), np.empty(0, dtype=np.uint8)]  # alternate between groups
        self._arena_turn = 0
        self._unwritten_bytes = 0  # committed since the last sync or writeback kick
        self._thread = threading.Thread(target=self._run, name="kvstore-disk-writer", daemon=True)
        self._thread.start()

    def submit(self, job: WriteJob | DeleteJob) -> None:
        """Queue a job (blocks while the queue is full)."""
        self._queue.put(job)

    def flush(self) -> None:
        """Block until every job queued before this call is committed (or dropped) and synced."""
        done = threading.Event()
        self._queue.put(FlushJob(done))
        done.wait()

    def stop(self) -> None:
        """Drain the queue, persist access times, sync and join the thread."""
        self._queue.put(_StopJob())
        self._thread.join()

    # -- the loop --------------------------------------------------------------------------------------------

    def _run(self) -> None:
        """Commit groups in order; the next group encodes on the pool while the current one is committed."""
        carry: _Job | None = None
        current: _Group | None = None
        while True:
            if current is None:
                jobs, carry = self._gather(carry, block=True)
                current = self._start(jobs)
            following: _Group | None = None
            if not current.stops:
                jobs, carry = self._gather(carry, block=False)
                following = self._start(jobs) if jobs else None
            self._complete(current)
            if current.stops:
                return
            current = following

    def _gather(self, carry: _Job | None, *, block: bool) -> tuple[list[_Job], _Job | None]:
        """Every job waiting, up to ``max_group_bytes`` of writes and up to the first stop job."""
        if carry is None:
            try:
                carry = self._queue.get(block=block)
            except queue.Empty:
                return [], None
        jobs = [carry]
        group_bytes = _job_bytes(carry)
        while not isinstance(jobs[-1], _StopJob):
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if group_bytes + _job_bytes(job) > self._options.max_group_bytes and group_bytes:
                return jobs, job
            jobs.append(job)
            group_bytes += _job_bytes(job)
        return jobs, None

    def _start(self, jobs: list[_Job]) -> _Group:
        """Form a group and start encoding its frames on the pool (into the arena the previous group left)."""
        writes = [job for job in jobs if isinstance(job, WriteJob)]
        group = _Group(jobs=jobs, writes=writes, encoded=[], lengths=self._pool.batch())
        try:
            codec, frame_bytes = self._codec, self._options.frame_bytes
            spans: list[_FrameSpan] = []
            arena_bytes = 0
            for job in writes:
                encoded = _Encoded(job=job, frame_spans=[], stored_bytes=meta_bytes(job.pending.record.num_tokens))
                group.encoded.append(encoded)
                data = job.pending.data
                for start in range(0, data.shape[0], frame_bytes):
                    source = data[start : start + frame_bytes]
                    spans.append((encoded, source, arena_bytes, codec.max_encoded_bytes(source.shape[0])))
                    arena_bytes += spans[-1][3]
            self._arena_turn ^= 1
            if self._arenas[self._arena_turn].shape[0] < arena_bytes:
                self._arenas[self._arena_turn] = np.empty(arena_bytes, dtype=np.uint8)
            group.arena = self._arenas[self._arena_turn]
            for encoded, source, offset, bound in spans:
                encoded.frame_spans.append((offset, 0))
                target = group.arena[offset : offset + bound]
                group.lengths.submit(functools.partial(codec.encode_into, source, target))
        except Exception as exc:  # reported (and the writes dropped) when the group completes
            group.error = exc
        return group

    def _complete(self, group: _Group) -> None:
        """Wait for the group's encoding, commit it, release its writes, sync if asked, wake flushers."""
        try:
            lengths = group.lengths.wait()
            if group.error is not None:
                raise group.error
            spans = [(encoded, idx) for encoded in group.encoded for idx in range(len(encoded.frame_spans))]
            for (encoded, idx), length in zip(spans, lengths, strict=True):
                encoded.frame_spans[idx] = (encoded.frame_spans[idx][0], length)
                encoded.stored_bytes += length
            deletes = [key for job in group.jobs if isinstance(job, DeleteJob) for key in job.keys]
            committed, rejected, failed = self._commit(group, deletes)
        except Exception as exc:  # the thread boundary: count, drop the group's writes, keep serving
            needed = sum(encoded.stored_bytes for encoded in group.encoded)
            if not (isinstance(exc, StorageError) and self._outage.explains(len(group.writes), needed)):
                logger.exception("disk writer: a group of %d jobs failed; its writes are dropped", len(group.jobs))
            for job in group.writes:
                self._finish(job, committed=None)
            if not group.writes:
                self._index.count_write_error()
        else:
            for encoded in committed:
                self._finish(encoded.job, committed=encoded)
            for job in rejected:
                self._finish(job, committed=None, rejected=True)
            for job in failed:
                self._finish(job, committed=None)
            self._unwritten_bytes += sum(encoded.stored_bytes for encoded in committed)
            flush_asked = group.stops or any(isinstance(job, FlushJob) for job in group.jobs)
            try:
                if flush_asked:
                    self._sync()
                elif 0 < self._options.writeback_bytes <= self._unwritten_bytes:
                    self._unwritten_bytes = 0
                    self._env.start_writeback()
            except Exception as exc:
                if not (isinstance(exc, StorageError) and self._outage.explains(0, 0)):
                    logger.exception("disk writer: sync failed; recent commits may not be durable")
                self._index.count_write_error()
        finally:
            for flush in group.jobs:
                if isinstance(flush, FlushJob):
                    flush.done.set()

    def _commit(self, group: _Group, deletes: list[PrefixKey]) -> tuple[list[_Encoded], list[WriteJob], list[WriteJob]]:
        """Make room under the cap, delete, then write the group; returns (committed, rejected, failed)."""
        encoded = list(group.encoded)
        incoming = sum(item.stored_bytes for item in encoded)
        victims: list[PrefixKey] = []
        rejected: list[WriteJob] = []
        overflow = self._index.overflow_bytes(incoming)
        if overflow:
            victims, freed = self._index.take_victims(overflow)
            while encoded and freed < overflow:  # pinned chunks fill the rest: the newest writes do not fit
                dropped = encoded.pop()
                overflow -= dropped.stored_bytes
                rejected.append(dropped.job)
            if rejected:
                logger.warning("disk tier full of pinned chunks: %d writes rejected", len(rejected))
        self._hand_over(victims)
        self._delete_and_touch(victims + deletes)
        if not encoded:
            return [], rejected, []
        committed = self._write_frames(encoded, group.arena)
        failed = [item.job for item in encoded[len(committed) :]]
        return committed, rejected, failed

    def _finish(self, job: WriteJob, *, committed: _Encoded | None, rejected: bool = False) -> None:
        key = job.pending.record.key
        if committed is not None:
            self._index.commit(
                key,
                stored_bytes=committed.stored_bytes,
                num_frames=len(committed.frame_spans),
                frame_bytes=self._options.frame_bytes,
            )
        else:
            self._index.abandon(key, rejected=rejected)
        self._index.wait_for_readers(job.pending)
        try:
            job.release()
        except Exception:  # a borrower's on_done failed: its problem, not the writer's
            logger.exception("disk writer: the release callback of chunk %s raised", key.hex())

    # -- transactions ----------------------------------------------------------------------------------------

    def _hand_over(self, victims: list[PrefixKey]) -> None:
        """Give capacity victims to ``on_evict`` before their delete commits (a failure there is only logged)."""
        sink = self._options.on_evict
        if sink is None or not victims:
            return
        try:
            sink(read_evicted(self._env, victims))
        except Exception:  # the eviction must go on: the victims' room is needed either way
            logger.exception("disk writer: handing %d evicted chunks on failed; they are deleted", len(victims))

    def _delete_and_touch(self, keys: list[PrefixKey]) -> None:
        """Delete chunks and persist changed last-access times in one transaction."""
        dirty = self._index.take_dirty_access()
        if not keys and not dirty:
            return
        env = self._env

        def body(txn: lmdb.Transaction[bytes]) -> None:
            delete_chunks(txn, env, keys)
            for key, last_access_ns in dirty.items():
                value = txn.get(key, db=env.meta_db)
                if value is not None:
                    txn.put(key, with_last_access(value, last_access_ns), db=env.meta_db)

        self._transact(body, "delete chunks", needed_bytes=0)

    def _write_frames(self, encoded: list[_Encoded], arena_array: npt.NDArray[np.uint8]) -> list[_Encoded]:
        """Commit the chunks in order in short transactions (commit); returns the leading ones committed.

        A transaction that fails is logged; the chunks it had begun are deleted (best effort: else the next
        open removes them through their intents) and the rest of ``encoded`` is left uncommitted.
        """
        arena = arena_array.data
        chunks: list[ChunkFrames] = []
        for item in encoded:
            pending = item.job.pending
            record = pending.record
            chunk = StoredChunk(
                key=record.key,
                num_tokens=record.num_tokens,
                source_start=record.source_start,
                raw_bytes=pending.data.shape[0],
                stored_bytes=item.stored_bytes,
                num_frames=len(item.frame_spans),
                frame_bytes=self._options.frame_bytes,
                last_access_ns=self._index.last_access_ns(record.key) or 0,
                tokens=record.tokens,
                parent_key=record.parent_key,
            )
            frames = tuple(arena[offset : offset + length] for offset, length in item.frame_spans)
            chunks.append(ChunkFrames(key=record.key, meta=encode_meta(chunk), frames=frames))
        num_committed = 0
        begun: list[PrefixKey] = []
        for transaction in plan_transactions(chunks, self._options.max_transaction_bytes):
            write = functools.partial(transaction.write, env=self._env)
            try:
                self._transact(write, "write chunks", needed_bytes=transaction.num_bytes)
            except StorageError:
                num_failed = len(encoded) - num_committed
                needed = sum(item.stored_bytes for item in encoded[num_committed:])
                if not self._outage.explains(num_failed, needed):
                    logger.exception(
                        "disk writer: %d of %d writes failed; their writes are dropped", num_failed, len(encoded)
                    )
                discard_unfinished(self._env, begun)
                break
            self._outage.committed()
            begun += [chunk.key for chunk in transaction.begins]
            num_committed += len(transaction.ends)
            del begun[: len(transaction.closed_intents)]  # chunks end in the order they begin
        return encoded[:num_committed]

    def _transact(self, body: Callable[[lmdb.Transaction[bytes]], None], action: str, *, needed_bytes: int) -> None:
        """Run ``body`` in a write transaction; on a full map grow it, else evict, and retry."""
        env = self._env
        for _ in range(_MAX_COMMIT_ATTEMPTS):
            try:
                with env.write() as txn:
                    body(txn)
                return
            except lmdb.MapFullError:
                map_bytes = env.map_size_bytes
                if map_bytes < self._options.max_map_bytes:
                    grown = max(map_bytes + map_bytes // 4, map_bytes + 2 * needed_bytes)
                    env.grow_map(min(grown, self._options.max_map_bytes))
                    continue
                victims, _ = self._index.take_victims(max(needed_bytes, 1))
                if not victims:
                    break
                self._hand_over(victims)
                self._delete_and_touch(victims)
        raise StorageError(
            f"disk writer could not {action}: the LMDB map of {env.path} is full at "
            f"{env.map_size_bytes / 2**20:.1f} MiB and nothing more can be evicted; raise capacity_bytes "
            "or the map limit"
        )

    def _sync(self) -> None:
        self._unwritten_bytes = 0
        self._delete_and_touch([])
        try:
            self._env.sync()
        except lmdb.Error as exc:
            raise storage_error(f"disk writer could not sync {self._env.path}", exc) from exc


def _job_bytes(job: _Job) -> int:
    return job.pending.data.shape[0] if isinstance(job, WriteJob) else 0
