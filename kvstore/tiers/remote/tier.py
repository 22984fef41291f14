"""``RemoteTier``: chunks in a Valkey (or Redis) deployment that every host of a fleet shares.

It sits below the local tiers and is not one of them: it cannot pin (Valkey's own eviction decides what leaves), it
is never on a lookup's path, and it may vanish at any moment. So it keeps the ``Tier`` vocabulary (``put``,
``put_borrowed``, ``stats``) but answers lookups from a local set of the keys it believes the remote holds:
``knows`` costs a set probe, no round trip. The set is filled by this host's own writes and by the content
directory (``directory.py``), and a fetch that finds a key gone removes it (the store's lazy two-strike rule then
retires the index entry).

Writes leave the caller's path: ``put`` copies the chunk (``put_borrowed`` borrows it until ``on_done``) and queues
it; one writer thread encodes chunks with the disk tier's codec (the same frames, ``remote_value.py``), sends a
batch of ``SET``\\ s in one pipeline, then the directory records of the runs that batch completed. A chunk already
known to be remote is not sent again. When the queue holds ``max_queued_bytes`` further puts are dropped and
counted (the remote is slower than the store is fed); during an outage the writer's calls fail fast and their
chunks are dropped and counted too. Nothing is retried: the chunks stay in the local tiers.

Resets: a Valkey restarted without persistence (or flushed) holds none of the chunks this host believes it holds,
and would never get them again (a chunk known to be remote is not sent). So every host keeps an eye on an epoch key
(``check_epoch``, on the directory reader's thread): the first host sets it to a random value; when it holds another
value, or is gone together with every directory shard, the remote was reset, and the host forgets every key it
believed remote (lookups stop planning them, new stores write them again) and reads the directory from its start.
One warning says so. An epoch key gone while the directory is still there was evicted (Valkey's LRU counts in
seconds, so a burst of writes can take it): it is put back with its old value, and nothing is forgotten -- unless a
server restarted since the last check (its ``run_id`` changed): then a directory shard may be one that a host's
first write after the restart recreated before anyone read the epoch, and the remote counts as reset. On a cluster,
a master that restarted is a reset whatever the epoch says: the epoch key may live on another master, and the
restarted one may have come back empty.

Reads: ``fetch`` gets many values in one round trip (``MGET``; per node on a cluster) and checks their headers;
``decode_into`` decodes one. A defective value is counted, deleted in the background and reported as a miss.

Threads: safe to share; ``_state_lock`` guards the key set, the queue and the counters.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import xxhash

from kvstore.keys import PrefixKey
from kvstore.layout import KVLayout
from kvstore.misses import MissReason
from kvstore.tiers.base import ChunkRecord, TierName, TierStats
from kvstore.tiers.frames.codec import FrameCodec, FrameStatus
from kvstore.tiers.frames.evicted import EvictedChunk
from kvstore.tiers.frames.host_copy import copy_tensor
from kvstore.tiers.frames.meta import balanced_frame_bytes, decode_meta
from kvstore.tiers.remote.directory import DirectoryFeed, DirectoryRun, publish_command
from kvstore.tiers.remote.link import RemoteLink
from kvstore.tiers.remote.names import RemoteNames
from kvstore.tiers.remote.remote_value import (
    RemoteChunk,
    assemble_remote_value,
    decode_remote_value,
    decode_remote_value_into,
    encode_remote_value,
)
from kvstore.tiers.shared import SharedTier

__all__ = ["DEFAULT_MAX_QUEUED_BYTES", "RemoteTier"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_QUEUED_BYTES = 512 * 2**20
_BATCH_BYTES = 32 * 2**20  # raw bytes of chunks encoded and sent in one pipeline
_DEFAULT_MAX_RUNS_PER_SHARD = 1 << 20
_REMEMBERED_CORRUPT = 4096  # keys whose values failed their checks, remembered to name the reason of their misses


@dataclass(slots=True)
class _ChunkWrite:
    record: ChunkRecord
    data: npt.NDArray[np.uint8]
    release: Callable[[], None]


@dataclass(slots=True)
class _ValueWrite:
    key: PrefixKey
    value: bytes
    raw_bytes: int


@dataclass(slots=True)
class _RunPublish:
    run: DirectoryRun


@dataclass(slots=True)
class _Delete:
    keys: list[PrefixKey]


@dataclass(slots=True)
class _Flush:
    done: threading.Event


_Job = _ChunkWrite | _ValueWrite | _RunPublish | _Delete | _Flush


class RemoteTier(SharedTier[RemoteChunk]):
    """The remote tier of one store (a ``SharedTier``: one Valkey, or a cluster, many hosts).

    Args:
        link: the connection (shared with nothing else).
        names: key names of the deployment and layout.
        layout: the model's KV layout.
        chunk_size: tokens per full chunk.
        host_id: this store's id in the directory (random per open).
        zstd_level: of the frames (the disk tier's default).
        max_queued_bytes: raw bytes of chunks waiting to be sent before puts are dropped.
        max_runs_per_shard: directory records each shard keeps (``XADD MAXLEN ~``).
    """

    name = TierName.REMOTE

    def __init__(
        self,
        link: RemoteLink,
        names: RemoteNames,
        layout: KVLayout,
        chunk_size: int,
        *,
        host_id: int,
        zstd_level: int = 1,
        max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES,
        max_runs_per_shard: int = _DEFAULT_MAX_RUNS_PER_SHARD,
    ) -> None:
        self.link = link
        self.names = names
        self.layout = layout
        self.host_id = host_id
        self._chunk_size = chunk_size
        self._codec = FrameCodec(layout.dtype.element_size_bytes, zstd_level=zstd_level)
        self._frame_bytes = balanced_frame_bytes(
            layout.chunk_bytes(chunk_size), layout.dtype.element_size_bytes, num_codec_threads=1
        )
        self._max_queued_bytes = max_queued_bytes
        self._max_runs_per_shard = max_runs_per_shard
        self._feed = DirectoryFeed(link, names, host_id)
        self._state_lock = threading.Lock()
        self._work = threading.Condition(self._state_lock)
        self._known: set[PrefixKey] = set()
        self._queue: collections.deque[_Job] = collections.deque()
        self._queued_bytes = 0
        self._closed = False
        self._puts = self._dropped_puts = self._failed_puts = 0
        self._raw_bytes_put = self._stored_bytes_put = 0
        self._hits = self._misses = self._corrupt_reads = self._forgotten = 0
        self._dropped_corrupt: collections.OrderedDict[PrefixKey, None] = collections.OrderedDict()
        self._warned_full_queue = False
        self._epoch: bytes | None = None
        self._server_runs: frozenset[str] | None = None  # the servers' run ids at the last epoch check
        self._resets = 0
        self._writer = threading.Thread(target=self._write_loop, name="kvstore-remote-writer", daemon=True)
        self._writer.start()

    # -- what the remote holds ----------------------------------------------------------------------------------

    def knows(self, key: PrefixKey) -> bool:
        """Whether the remote is believed to hold the chunk (this host wrote it, or the directory says so)."""
        return key in self._known

    def why_forgotten(self, key: PrefixKey) -> MissReason:
        """Why a key this tier no longer knows is not read: its value failed its checks and was deleted (among
        the last ``_REMEMBERED_CORRUPT`` such), else Valkey had evicted it."""
        with self._state_lock:
            return MissReason.CHECKSUM if key in self._dropped_corrupt else MissReason.EVICTED_REMOTE

    def learn(self, keys: Iterable[PrefixKey]) -> None:
        with self._state_lock:
            self._known.update(keys)

    def forget(self, keys: Iterable[PrefixKey]) -> None:
        """The remote no longer holds these (a fetch missed): lookups stop planning them."""
        with self._state_lock:
            for key in keys:
                if key in self._known:
                    self._known.discard(key)
                    self._forgotten += 1

    def check_epoch(self) -> bool:
        """Detect a reset remote (see the module docstring); ``True`` when this call found one."""
        checked = self.link.call(self._read_epoch, default=None, what="check the remote's epoch")
        if checked is None:
            return False  # an outage: nothing known (the run ids are kept only from a whole check)
        current, self._server_runs = checked
        with self._state_lock:
            previous, self._epoch = self._epoch, bytes(current)
            if previous is None or previous == self._epoch:
                return False
            forgotten = len(self._known)
            self._known.clear()
            self._resets += 1
        self._feed.rewind()
        logger.warning(
            "remote tier %s was reset (its data is gone: restarted empty or flushed): forgetting the %d chunks "
            "believed held there; chunks are written to it again as they are stored",
            self.link.address.describe(),
            forgotten,
        )
        return True

    def _read_epoch(self, client: Any) -> tuple[bytes, frozenset[str]]:
        """The remote's epoch, set, put back or renewed as needed (see the module docstring), and the servers'
        run ids."""
        name = self.names.epoch()
        runs = _server_runs(client, self.link.is_cluster)
        restarted = self._server_runs is not None and runs != self._server_runs
        value: bytes | None = client.get(name)
        if value is not None and not (restarted and self.link.is_cluster):
            return value, runs
        known = self._epoch
        if restarted:  # whatever holds the epoch now, chunks this host believed held may be gone
            # named after the new run ids, so every host that sees this restart writes the same epoch: a random
            # one per host made each host's renewal another reset for the hosts that renewed before it
            renewed = xxhash.xxh3_64_hexdigest("\n".join(sorted(runs)).encode()).encode()
            client.set(name, renewed)
            return renewed, runs
        if known is not None:
            pipe = client.pipeline(transaction=False)
            for shard in self.names.directory_shards():
                pipe.exists(shard)
            if any(pipe.execute()):  # only the epoch key was evicted: put it back as it was
                return client.set(name, known, nx=True, get=True) or known, runs
        candidate = os.urandom(8).hex().encode()
        return client.set(name, candidate, nx=True, get=True) or candidate, runs

    def read_directory(self) -> list[DirectoryRun] | None:
        """Runs other hosts published since the last call (``None`` during an outage); their keys are learnt."""
        runs = self._feed.read_new()
        if runs:
            self.learn(key for run in runs for key in run.keys)
        return runs

    # -- writes -------------------------------------------------------------------------------------------------

    def put(self, record: ChunkRecord, kv: torch.Tensor) -> bool:
        """Copy a chunk and queue it; ``False`` when dropped (queue full, closed, or already remote)."""
        if self.knows(record.key):
            return False
        staged = torch.empty(kv.shape, dtype=kv.dtype)
        copy_tensor(staged, kv)
        return self._enqueue(record, staged.reshape(-1).view(torch.uint8).numpy(), _nothing)

    def put_borrowed(self, record: ChunkRecord, kv: torch.Tensor, on_done: Callable[[], None]) -> bool:
        """Queue a chunk without copying: ``kv`` (a contiguous cpu tensor) is read in place until ``on_done``,
        which is called exactly once (at once when the chunk is not queued)."""
        if self.knows(record.key):
            on_done()
            return False
        if kv.device.type != "cpu" or not kv.is_contiguous():
            on_done()
            return self.put(record, kv)
        return self._enqueue(record, kv.detach().reshape(-1).view(torch.uint8).numpy(), on_done)

    def _enqueue(self, record: ChunkRecord, data: npt.NDArray[np.uint8], release: Callable[[], None]) -> bool:
        admitted = self._admit(_ChunkWrite(record, data, release), data.shape[0])
        if not admitted:
            release()
        return admitted

    def _admit(self, job: _ChunkWrite | _ValueWrite, num_bytes: int) -> bool:
        """Queue a write unless the queue holds ``max_queued_bytes`` (then count it dropped, warn once)."""
        with self._state_lock:
            admitted = not self._closed and self._queued_bytes + num_bytes <= self._max_queued_bytes
            if admitted:
                self._queue.append(job)
                self._queued_bytes += num_bytes
                self._work.notify()
            else:
                self._dropped_puts += 1
                warn = not self._closed and not self._warned_full_queue
                self._warned_full_queue |= warn
        if not admitted and warn:
            logger.warning(
                "remote tier %s: %d MiB of chunks already wait to be sent; new chunks are not written to the "
                "remote until the queue drains (counted in rejected_puts; logged once)",
                self.link.address.describe(),
                self._max_queued_bytes >> 20,
            )
        return admitted

    def put_evicted(self, chunks: Sequence[EvictedChunk]) -> list[ChunkRecord]:
        """Queue chunks the disk tier evicted, as it stored them (no decode, no re-encode); returns the records of
        those queued, for their directory runs. Chunks already remote, damaged or over the queue's bound are
        skipped (the latter counted)."""
        queued: list[ChunkRecord] = []
        for chunk in chunks:
            stored = decode_meta(chunk.key, chunk.meta)
            if stored is None or self.knows(chunk.key):
                continue
            value = assemble_remote_value(stored, chunk.frames)
            record = ChunkRecord(
                key=stored.key, source_start=stored.source_start, tokens=stored.tokens, parent_key=stored.parent_key
            )
            if self._admit(_ValueWrite(chunk.key, value, stored.raw_bytes), len(value)):
                queued.append(record)
        return queued

    def publish(self, run: DirectoryRun) -> None:
        """Queue a run's directory record behind its chunks (only the chunks that reach the remote are published)."""
        self._submit(_RunPublish(run))

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything queued so far was sent (or dropped); ``False`` on timeout."""
        done = threading.Event()
        if not self._submit(_Flush(done)):
            return True
        return done.wait(timeout_s)

    def _submit(self, job: _Job) -> bool:
        with self._state_lock:
            if self._closed:
                return False
            self._queue.append(job)
            self._work.notify()
            return True

    def _write_loop(self) -> None:
        while True:
            with self._state_lock:
                while not self._queue and not self._closed:
                    self._work.wait()
                if not self._queue:
                    return
                batch = self._take_batch()
            try:
                self._send(batch)
            except Exception:  # a bug must not kill the writer: the store would silently stop writing
                logger.exception("remote tier writer: a batch failed; its chunks stay local only")
            finally:
                for job in batch:
                    if isinstance(job, _ChunkWrite):
                        job.release()
                    elif isinstance(job, _Flush):
                        job.done.set()

    def _take_batch(self) -> list[_Job]:
        """Jobs in queue order up to ``_BATCH_BYTES`` of chunks (called under the lock)."""
        batch: list[_Job] = []
        batch_bytes = 0
        while self._queue and batch_bytes < _BATCH_BYTES:
            job = self._queue.popleft()
            if isinstance(job, _ChunkWrite | _ValueWrite):
                size = job.data.shape[0] if isinstance(job, _ChunkWrite) else len(job.value)
                self._queued_bytes -= size
                batch_bytes += size
            batch.append(job)
        return batch

    def _send(self, batch: Sequence[_Job]) -> None:
        now_ns = time.time_ns()
        writes = [job for job in batch if isinstance(job, _ChunkWrite)]
        values = [(job.record.key, self.encode(job.record, job.data, now_ns=now_ns)) for job in writes]
        ready = [job for job in batch if isinstance(job, _ValueWrite)]
        values += [(job.key, job.value) for job in ready]
        raw_bytes = sum(job.data.shape[0] for job in writes) + sum(job.raw_bytes for job in ready)
        deletes = [key for job in batch if isinstance(job, _Delete) for key in job.keys]
        if values or deletes:
            self.put_values(values, raw_bytes=raw_bytes, deletes=deletes)
        runs = [piece for job in batch if isinstance(job, _RunPublish) for piece in self._held_pieces(job.run)]
        if runs:
            shards = [self.names.directory_shard(self.names.shard_of(run.keys[0])) for run in runs]
            self.link.call_keyed(
                shards, lambda client, picked: self._publish_some(client, runs, picked), default=False,
                what="publish directory",
            )  # fmt: skip

    def encode(self, record: ChunkRecord, data: npt.NDArray[np.uint8], *, now_ns: int) -> bytes:
        """A chunk's raw KV bytes as one remote value (the writer's first step, on its thread)."""
        return encode_remote_value(record, data, self._codec, self._frame_bytes, now_ns=now_ns)

    def put_values(
        self, values: Sequence[tuple[PrefixKey, bytes]], *, raw_bytes: int, deletes: Sequence[PrefixKey] = ()
    ) -> bool:
        """Send encoded chunk values (``encode_remote_value``) in one pipeline, now, on the calling thread.

        The writer's last step, public for a caller that already holds frames (and for ``kvstore bench remote``,
        which measures it against raw ``SET`` commands). Returns ``False`` when the remote could not take them.
        """
        names = [self.names.chunk(key) for key, _ in values] + [self.names.chunk(key) for key in deletes]

        def set_some(client: Any, picked: list[int]) -> list[bool]:
            pipe = client.pipeline(transaction=False)
            for index in picked:
                if index < len(values):
                    pipe.set(names[index], values[index][1])
                else:
                    pipe.delete(names[index])
            pipe.execute()
            return [True] * len(picked)

        done = self.link.call_keyed(names, set_some, default=False, what=f"write {len(values)} chunks")
        stored = [value for value, sent in zip(values, done, strict=False) if sent]
        stored_bytes = sum(len(value) for _, value in stored)
        all_bytes = sum(len(value) for _, value in values)
        with self._state_lock:
            self._failed_puts += len(values) - len(stored)
            self._known.update(key for key, _ in stored)
            self._puts += len(stored)
            # values a lost master did not take leave out their share of the raw bytes (prorated by size)
            self._raw_bytes_put += raw_bytes * stored_bytes // all_bytes if all_bytes else 0
            self._stored_bytes_put += stored_bytes
        return len(stored) == len(values)

    def _publish_some(self, client: Any, runs: Sequence[DirectoryRun], picked: list[int]) -> list[bool]:
        pipe = client.pipeline(transaction=False)
        for index in picked:
            publish_command(pipe, self.names, runs[index], self.host_id, self._max_runs_per_shard)
        pipe.execute()
        return [True] * len(picked)

    def _held_pieces(self, run: DirectoryRun) -> list[DirectoryRun]:
        """The parts of ``run`` whose chunks the remote holds (chunks that failed or were dropped cut it)."""
        held = [self.knows(key) for key in run.keys]
        pieces: list[DirectoryRun] = []
        start = 0
        while start < len(held):
            if not held[start]:
                start += 1
                continue
            end = start
            while end < len(held) and held[end]:
                end += 1
            pieces.append(_slice_run(run, start, end, self._chunk_size))
            start = end
        return pieces

    # -- reads --------------------------------------------------------------------------------------------------

    def fetch(self, keys: Sequence[PrefixKey]) -> list[RemoteChunk | MissReason]:
        """Get many chunks' values in one round trip; for each one not read, why (``SharedTier.fetch``).

        Misses of known keys are forgotten; defective values are counted and deleted in the background.
        """
        if not keys:
            return []
        names = [self.names.chunk(key) for key in keys]

        def get_some(client: Any, picked: list[int]) -> list[bytes | bool | None]:
            some = [names[index] for index in picked]
            return list(client.mget_nonatomic(some) if self.link.is_cluster else client.mget(some))

        unanswered: bytes | bool | None = False  # the key's master did not answer: nothing learnt, nothing counted
        values = self.link.call_keyed(names, get_some, default=unanswered, what=f"get {len(keys)} chunks")
        namespace = self.layout.namespace
        chunks: list[RemoteChunk | MissReason] = [MissReason.REMOTE_UNAVAILABLE] * len(keys)
        missing: list[PrefixKey] = []
        corrupt: list[PrefixKey] = []
        for index, (key, value) in enumerate(zip(keys, values, strict=True)):
            if isinstance(value, bytes):
                chunk = decode_remote_value(key, value, namespace)
                if chunk is None:
                    corrupt.append(key)
                chunks[index] = chunk if chunk is not None else MissReason.CHECKSUM
            elif value is None:
                missing.append(key)
                chunks[index] = MissReason.EVICTED_REMOTE
        reached = sum(not isinstance(value, bool) for value in values)
        with self._state_lock:
            self._hits += reached - len(missing) - len(corrupt)
            self._misses += len(missing) + len(corrupt)
        self.forget(missing)
        if corrupt:
            self._drop_corrupt(corrupt, "a bad header or meta record")
        return chunks

    def decode_into(self, chunk: RemoteChunk, out: torch.Tensor) -> bool:
        """Decode a fetched chunk into ``out`` (any device and strides, the chunk's shape); ``False`` if corrupt."""
        if out.device.type == "cpu" and out.is_contiguous():
            status = decode_remote_value_into(chunk, self._codec, out.detach().reshape(-1).view(torch.uint8).numpy())
        else:
            staged = torch.empty(out.shape, dtype=out.dtype)
            status = decode_remote_value_into(chunk, self._codec, staged.reshape(-1).view(torch.uint8).numpy())
            if status is FrameStatus.OK:
                out.copy_(staged)
        if status is FrameStatus.OK:
            return True
        self._drop_corrupt([chunk.record.key], status.value)
        return False

    def count_inconsistent(self, key: PrefixKey) -> None:
        """Count a fetched value that holds another number of tokens than the plan (a directory record of another
        length): a miss, counted with the damaged values. The value stays: it serves its own length. The caller
        logs it."""
        with self._state_lock:
            self._corrupt_reads += 1

    def _drop_corrupt(self, keys: list[PrefixKey], cause: str) -> None:
        with self._state_lock:
            self._corrupt_reads += len(keys)
            self._dropped_corrupt.update(dict.fromkeys(keys))
            while len(self._dropped_corrupt) > _REMEMBERED_CORRUPT:
                self._dropped_corrupt.popitem(last=False)
        self.forget(keys)
        logger.warning(
            "remote tier %s: %d chunk value(s) failed their checks (%s), e.g. %s; deleted, read as misses",
            self.link.address.describe(),
            len(keys),
            cause,
            keys[0].hex(),
        )
        self._submit(_Delete(keys))

    # -- admin --------------------------------------------------------------------------------------------------

    def stats(self) -> TierStats:
        """Counters of this host's use of the remote (``num_chunks``: keys this host believes it holds)."""
        with self._state_lock:
            return TierStats(
                tier=TierName.REMOTE,
                capacity_bytes=0,
                used_bytes=self._raw_bytes_put,
                stored_bytes=self._stored_bytes_put,
                num_chunks=len(self._known),
                num_pinned=0,
                puts=self._puts,
                rejected_puts=self._dropped_puts + self._failed_puts,
                evictions=self._forgotten,
                corrupt_reads=self._corrupt_reads,
            )

    def link_stats(self) -> tuple[bool, int, int, int, int, int, int, int]:
        """``(available, outages, resets, failed calls, skipped calls, queued bytes, directory records, bad
        records)``."""
        link = self.link.stats
        with self._state_lock:
            queued, resets = self._queued_bytes, self._resets
        feed = self._feed
        return (self.link.available, link.outages, resets, link.failed_calls, link.skipped_calls, queued,
                feed.num_records, feed.num_bad_records)  # fmt: skip

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (bounded by ``timeout_s``), stop the writer, close the link. Idempotent."""
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
            self._work.notify_all()
        self._writer.join(timeout_s)
        with self._state_lock:
            left = list(self._queue)
            self._queue.clear()
        for job in left:  # the writer did not finish in time: release what it still borrowed
            if isinstance(job, _ChunkWrite):
                job.release()
        self.link.close()


def _slice_run(run: DirectoryRun, start: int, end: int, chunk_tokens: int) -> DirectoryRun:
    """Chunks ``[start, end)`` of a run, starting where the chunks before them end: their lengths say where (chunks
    may be short mid-run: a separator's or a content-defined cut); a run without content hashes has no lengths, and
    is taken as full chunks of ``chunk_tokens`` (it serves prefix lookups only)."""
    if start == 0 and end == len(run.keys):
        return run
    skipped = int(run.lengths[:start].astype(np.int64).sum()) if run.has_contents else start * chunk_tokens
    return DirectoryRun(
        keys=run.keys[start:end],
        source_start=run.source_start + skipped,
        fingerprint_bits=run.fingerprint_bits,
        fingerprints=run.fingerprints[start:end],
        verifications=run.verifications[start:end],
        lengths=run.lengths[start:end],
    )


def _nothing() -> None:
    pass


def _server_runs(client: Any, is_cluster: bool) -> frozenset[str]:
    """The run ids of the remote's servers (each master of a cluster): a new one means a server restarted."""
    if not is_cluster:
        return frozenset([str(client.info("server").get("run_id", ""))])
    replies = client.info("server", target_nodes=client.__class__.PRIMARIES)
    return frozenset(str(info.get("run_id", "")) for info in replies.values())
