"""Asynchronous fingerprint registration: index stored chunks by content off the store path.

``TieredStore.store`` commits a sequence's chunks to their tiers, then hands the sequence to this worker and
returns; one thread registers it in the ``FingerprintIndex`` and calls the job's ``on_done`` (the store drops the
chunks' eviction shields there). Ordering and guarantees:

- jobs run in submission order, each after its chunks' commit (the store submits only committed chunks);
- a failure is logged and counted, never raised into ``store``; ``on_done`` then gets ``None``;
- while a job waits, its keys are *pending*: ``is_pending`` lets lookups leave them unstruck;
- ``wait_submitted`` is the barrier a lookup takes so it sees every registration submitted before it started.

Threads: callers on any thread; one worker thread. ``_queue_lock`` (with ``_changed``) guards the queue, the
counters and the pending-key counts; the index and ``on_done`` are called without it.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.content.index import FingerprintIndex, RegistrationResult
from kvstore.errors import StoreClosedError
from kvstore.keys import PrefixKey, TokenArray
from kvstore.stats import RegistrationStats

__all__ = ["RegistrationJob", "RegistrationWorker"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class RegistrationJob:
    """A run of consecutive committed chunks of one stored sequence.

    Args:
        tokens: the run's tokens (chunked by the store's chunk size; the last chunk may be partial).
        keys: the prefix key of each chunk of the run.
        chunk_ends: where each chunk ends in ``tokens`` (``FingerprintIndex.register``; ``None``: every
            ``chunk_size`` tokens).
        source_start: position of ``tokens[0]`` in the stored sequence.
        on_done: called on the worker thread with the index's answer, or ``None`` when registration failed.
    """

    tokens: TokenArray
    keys: Sequence[PrefixKey]
    source_start: int
    on_done: Callable[[RegistrationResult | None], None]
    chunk_ends: Sequence[int] | None = None


class RegistrationWorker:
    """One thread that registers submitted sequences in a ``FingerprintIndex``, in order.

    Args:
        index: the index to register into.
        chunk_size: tokens per chunk of the store.
    """

    def __init__(self, index: FingerprintIndex, chunk_size: int) -> None:
        self._index = index
        self._chunk_size = chunk_size
        self._queue_lock = threading.Lock()
        self._changed = threading.Condition(self._queue_lock)
        self._queue: collections.deque[RegistrationJob] = collections.deque()
        self._pending_keys: collections.Counter[PrefixKey] = collections.Counter()
        self._num_submitted = 0
        self._num_done = 0
        self._num_chunks_registered = 0
        self._num_failed = 0
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="kvstore-fingerprints", daemon=True)
        self._thread.start()

    def submit(self, job: RegistrationJob) -> None:
        """Queue a job; its keys count as pending until it has run.

        Raises:
            StoreClosedError: the worker was closed.
        """
        with self._changed:
            if self._closing:
                raise StoreClosedError("fingerprint registration has stopped; open a new TieredStore")
            self._queue.append(job)
            self._pending_keys.update(job.keys)
            self._num_submitted += 1
            self._changed.notify_all()

    def is_pending(self, key: PrefixKey) -> bool:
        with self._queue_lock:
            return key in self._pending_keys

    def wait_submitted(self) -> None:
        """Block until every job submitted before this call has run (registered or failed)."""
        with self._changed:
            target = self._num_submitted
            while self._num_done < target and self._thread.is_alive():
                self._changed.wait()

    def stats(self) -> RegistrationStats:
        with self._queue_lock:
            return RegistrationStats(
                num_jobs=self._num_done,
                num_chunks_registered=self._num_chunks_registered,
                num_failed_jobs=self._num_failed,
                num_pending_jobs=self._num_submitted - self._num_done,
            )

    def close(self) -> None:
        """Run the queued jobs, then stop the thread. Idempotent."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._queue and not self._closing:
                    self._changed.wait()
                if not self._queue:
                    return
                job = self._queue[0]
            result = self._register(job)
            try:
                job.on_done(result)
            except Exception:
                logger.exception("fingerprint registration: the completion callback failed")
            with self._changed:
                self._queue.popleft()
                for key in job.keys:
                    self._pending_keys[key] -= 1
                    if not self._pending_keys[key]:
                        del self._pending_keys[key]
                self._num_done += 1
                if result is None:
                    self._num_failed += 1
                else:
                    self._num_chunks_registered += len(job.keys)
                self._changed.notify_all()

    def _register(self, job: RegistrationJob) -> RegistrationResult | None:
        try:
            return self._index.register(
                job.tokens, job.keys, self._chunk_size, job.source_start, chunk_ends=job.chunk_ends
            )
        except Exception:
            logger.exception(
                "fingerprint registration failed for %d chunks from position %d; they stay cached but will not "
                "be found by content",
                len(job.keys),
                job.source_start,
            )
            return None
