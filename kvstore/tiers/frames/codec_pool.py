"""A small thread pool that encodes or decodes the frames of a request in parallel, the caller working too.

zstd, xxhash and the numba shuffle kernels release the GIL, so the frames of one chunk (or one group commit)
spread over threads. Work is handed over as a ``TaskBatch``: each ``submit`` queues one frame for the helpers
at once (so a reader can fetch frame ``i + 1`` from LMDB while helpers decode frame ``i``, and the writer can
encode the next group while it commits the current one), and ``wait`` runs on the calling thread every task no
helper has started yet (a batch always progresses, even when every helper is busy with another request) before
it collects the results.

Threads: ``num_threads`` helper threads (``kvstore-codec-N``) owned by the pool, plus the threads that submit
and wait. A ``TaskBatch`` belongs to the thread that created it; the executor is thread-safe.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

from kvstore.errors import ConfigError

__all__ = ["CodecPool", "TaskBatch"]

T = TypeVar("T")


class TaskBatch(Generic[T]):
    """Tasks of one request, started on the pool as they are submitted; results come back in submit order."""

    def __init__(self, executor: ThreadPoolExecutor | None) -> None:
        self._executor = executor
        self._calls: list[Callable[[], T]] = []
        self._futures: list[Future[T] | None] = []

    def __len__(self) -> int:
        return len(self._calls)

    def submit(self, call: Callable[[], T]) -> None:
        """Queue ``call`` for a helper (or for ``wait`` when the pool has no helpers)."""
        self._calls.append(call)
        self._futures.append(self._executor.submit(call) if self._executor is not None else None)

    def wait(self) -> list[T]:
        """Run unstarted tasks here, wait for the rest, and return every result.

        Every task has finished when this returns or raises (tasks may read memory that the caller frees
        afterwards, such as an LMDB read transaction's map). The first exception raised by a task is
        re-raised.
        """
        results: list[T | None] = [None] * len(self._calls)
        error: BaseException | None = None
        for index in reversed(range(len(self._calls))):  # steal from the end: helpers work from the front
            future = self._futures[index]
            if future is None or future.cancel():
                self._futures[index] = None
                try:
                    results[index] = self._calls[index]()
                except BaseException as exc:
                    error = error or exc
        started = [future for future in self._futures if future is not None]
        concurrent.futures.wait(started)
        for index, future in enumerate(self._futures):
            if future is not None:
                failure = future.exception()
                if failure is not None:
                    error = error or failure
                else:
                    results[index] = future.result()
        if error is not None:
            raise error
        return results  # type: ignore[return-value]  # every slot is filled unless an exception left above


class CodecPool:
    """Helper threads shared by the disk tier's readers and its writer.

    Args:
        num_threads: helper threads; 0 runs every task on the thread that waits for it.
    """

    def __init__(self, num_threads: int) -> None:
        if num_threads < 0:
            raise ConfigError(f"num_codec_threads={num_threads} must be 0 or more (2 suits a 2-core machine)")
        self.num_threads = num_threads
        self._executor = (
            ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="kvstore-codec") if num_threads else None
        )

    def batch(self) -> TaskBatch[T]:
        """A new, empty batch whose tasks start on the helpers as they are submitted."""
        return TaskBatch(self._executor)

    def close(self) -> None:
        """Join the helper threads. Idempotent."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
