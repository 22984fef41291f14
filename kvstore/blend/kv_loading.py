"""Loading a plan's cached KV while the model computes: ``store.retrieve`` on a worker thread (a side CUDA stream).

A blended prefill needs no cached KV until the first layer that reuses some (the check layer, when the plan has no
exact segments): the layers before it compute every token fresh. So the retrieve runs on ``KVLoader``'s worker
thread, straight into the prompt's KV buffer on the model device, while the main thread computes those layers::

    main thread   : lookup | layer 0 | ... | layer c-1 | wait | layer c (check) | ... | last layer
    loader thread :        | retrieve(plan, out=kv) ----------->|
                             (cpu tier: H2D copies from its pinned slots; gpu tier: D2D; disk: decode + copy)

On CUDA the worker makes a side stream current, so its copies overlap the compute stream's kernels; it first waits
for the compute stream (the buffer's zero fill) and records an event after the last copy, which the compute stream
waits on in ``PendingLoad.wait`` (a GPU-side wait: the host only blocks until the retrieve has queued its copies).
On the CPU the same thread, future and buffer are used, so CPU tests run the same logic. Both threads run under
``torch.inference_mode`` (the buffer is an inference tensor, which only inference mode may write).

Why not layer by layer: ``TieredStore.retrieve`` copies whole chunks (all layers of a chunk at once); a per-layer
pipeline (load layer l+1 while computing layer l) needs a store API that hands out a layer's slice of each pinned
chunk, which the store does not have yet.

Threads: one worker thread per ``KVLoader`` (``kvstore-blend-load``), joined in ``close``. A ``PendingLoad`` belongs
to the prefill that started it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvstore.plan import RetrieveResult

__all__ = ["KVLoader", "PendingLoad"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Loaded:
    result: RetrieveResult
    started: torch.cuda.Event | None
    finished: torch.cuda.Event | None
    wall_ms: float


class PendingLoad:
    """A retrieve in flight; ``wait`` returns its result once the compute stream may read the buffer."""

    def __init__(self, future: concurrent.futures.Future[_Loaded], device: torch.device) -> None:
        self._future = future
        self._device = device
        self._loaded: _Loaded | None = None

    def wait(self) -> RetrieveResult:
        """Block until the retrieve has run; on CUDA the current stream then waits for its copies.

        Raises:
            whatever the retrieve raised (the store has released the plan's pins by then).
        """
        if self._loaded is None:
            self._loaded = self._future.result()
            if self._loaded.finished is not None:
                torch.cuda.current_stream(self._device).wait_event(self._loaded.finished)
        return self._loaded.result

    def settle(self) -> None:
        """Wait for the worker without raising (a prefill failing elsewhere must not leave it writing)."""
        concurrent.futures.wait([self._future])

    def duration_ms(self) -> float:
        """How long the retrieve took, overlapped or not (on CUDA by its stream's events: synchronise first)."""
        loaded = self._loaded
        if loaded is None:
            return 0.0
        if loaded.started is not None and loaded.finished is not None:
            return float(loaded.started.elapsed_time(loaded.finished))
        return loaded.wall_ms


class KVLoader:
    """Runs retrieves into device buffers on one worker thread, off the compute stream.

    Args:
        device: the model's device; on CUDA the worker copies on its own stream.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._stream: torch.cuda.Stream | None = None
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-blend-load")

    def start(self, retrieve: Callable[[torch.Tensor], RetrieveResult], out: torch.Tensor) -> PendingLoad:
        """Call ``retrieve(out)`` on the worker; ``out`` is the KV buffer on the model device.

        The compute stream's work queued so far (e.g. ``out``'s zero fill) happens before the copies.
        """
        stream = self._stream
        compute = torch.cuda.current_stream(self._device) if stream is not None else None
        if stream is not None:
            out.record_stream(stream)  # the allocator must not hand the buffer out again before the copies finish

        def run() -> _Loaded:
            started_s = time.perf_counter()
            with torch.inference_mode():
                if stream is None:
                    result = retrieve(out)
                    return _Loaded(result, None, None, (time.perf_counter() - started_s) * 1e3)
                assert compute is not None
                with torch.cuda.stream(stream):
                    stream.wait_stream(compute)
                    started = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                    started.record(stream)
                    result = retrieve(out)
                    finished = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                    finished.record(stream)
                return _Loaded(result, started, finished, (time.perf_counter() - started_s) * 1e3)

        return PendingLoad(self._executor.submit(run), self._device)

    def close(self) -> None:
        """Finish the retrieve in flight (if any) and join the worker. Idempotent."""
        self._executor.shutdown(wait=True)
