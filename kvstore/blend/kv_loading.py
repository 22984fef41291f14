"""Loading a plan's cached KV while the model computes: a layer-by-layer retrieve on a worker thread.

A blended prefill needs layer ``l`` of the cached KV only when it reaches layer ``l``. So the retrieve runs on
``KVLoader``'s worker thread, straight into the prompt's KV buffer on the model device, copying every chunk's layer
0, then every chunk's layer 1, and so on (``TieredStore.retrieve(progress=...)``), while the main thread computes::

    main thread   : lookup | layer 0 | layer 1 | layer 2 | ...          | last layer
    loader thread :        | disk decode | L0 | L1 | L2 | ... | L31 |
                                         ^ segments known   ^ each layer: an event the compute stream waits on

The compute stream waits only for the layer it is about to read (``PendingLoad.wait_layer``), so with the KV in the
cpu tier (pinned host slots: copies at the pinned host-to-device rate) the load hides under the compute of the
layers before it instead of sitting in front of the first layer that reads the cache.

On CUDA the worker makes a side stream current, so its copies overlap the compute stream's kernels; it first waits
for the compute stream (the buffer's zero fill) and records an event after each layer's copies, which the compute
stream waits on (a GPU-side wait: the host only blocks until the retrieve has *queued* that layer). On the CPU the
same thread, progress and buffer are used, so CPU tests run the same logic. Both threads run under
``torch.inference_mode`` (the buffer is an inference tensor, which only inference mode may write).

Threads: one worker thread per ``KVLoader`` (``kvstore-blend-load``), joined in ``close``. A ``PendingLoad`` belongs
to the prefill that started it; its progress is shared between the two threads under one condition variable.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvstore.plan import RetrieveProgress, RetrieveResult, Segment

__all__ = ["KVLoader", "PendingLoad"]

logger = logging.getLogger(__name__)

Retrieve = Callable[[torch.Tensor, RetrieveProgress], RetrieveResult]
"""``retrieve(out, progress)``: a layer-by-layer ``TieredStore.retrieve`` (or ``Session.retrieve``) of one plan."""


@dataclass(frozen=True, slots=True)
class _Loaded:
    result: RetrieveResult
    started: torch.cuda.Event | None
    finished: torch.cuda.Event | None
    wall_ms: float


class _LayerProgress(RetrieveProgress):
    """What the worker has queued so far: the final segments, then one layer after another (with CUDA events)."""

    def __init__(self, stream: torch.cuda.Stream | None) -> None:
        self._stream = stream
        self._changed = threading.Condition()
        self._segments: tuple[Segment, ...] | None = None
        self._events: list[torch.cuda.Event | None] = []
        self._over = False

    def segments_loaded(self, segments: tuple[Segment, ...]) -> None:
        with self._changed:
            self._segments = segments
            self._changed.notify_all()

    def layer_queued(self, layer: int) -> None:
        event: torch.cuda.Event | None = None
        if self._stream is not None:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self._stream)
        with self._changed:
            assert layer == len(self._events), "a retrieve reports its layers in order"
            self._events.append(event)
            self._changed.notify_all()

    def end(self) -> None:
        """The retrieve returned or raised: wake anyone still waiting for a report that will not come."""
        with self._changed:
            self._over = True
            self._changed.notify_all()

    def wait_segments(self) -> tuple[Segment, ...] | None:
        with self._changed:
            self._changed.wait_for(lambda: self._segments is not None or self._over)
            return self._segments

    def wait_layer(self, layer: int) -> tuple[bool, torch.cuda.Event | None]:
        """Whether ``layer`` was queued, and its event (``None`` on the CPU)."""
        with self._changed:
            self._changed.wait_for(lambda: len(self._events) > layer or self._over)
            if len(self._events) > layer:
                return True, self._events[layer]
            return False, None


class PendingLoad:
    """A retrieve in flight, layer by layer: ``segments`` first, then ``wait_layer`` before reading each layer."""

    def __init__(
        self, future: concurrent.futures.Future[_Loaded], progress: _LayerProgress, device: torch.device
    ) -> None:
        self._future = future
        self._progress = progress
        self._device = device

    def segments(self) -> tuple[Segment, ...]:
        """The segments whose KV will be in the buffer (a chunk that failed to decode is already a gap).

        Raises:
            whatever the retrieve raised (the store has released the plan's pins by then).
        """
        segments = self._progress.wait_segments()
        if segments is None:
            return self._future.result().result.segments  # raises the retrieve's error
        return segments

    def wait_layer(self, layer: int) -> None:
        """Block until ``layer`` is queued; on CUDA the current stream then waits for its copies to land.

        Raises:
            whatever the retrieve raised before queuing the layer.
        """
        queued, event = self._progress.wait_layer(layer)
        if not queued:
            self._future.result()  # raises the retrieve's error
            raise AssertionError(f"the retrieve returned without queuing layer {layer}")
        if event is not None:
            torch.cuda.current_stream(self._device).wait_event(event)

    def settle(self) -> None:
        """Wait for the worker without raising (a prefill failing elsewhere must not leave it writing)."""
        concurrent.futures.wait([self._future])

    def duration_ms(self) -> float:
        """How long the whole retrieve took, overlapped or not (on CUDA by its stream's events: synchronise
        first); 0 when it failed."""
        if not self._future.done() or self._future.exception() is not None:
            return 0.0
        loaded = self._future.result()
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

    def start(self, retrieve: Retrieve, out: torch.Tensor) -> PendingLoad:
        """Call ``retrieve(out, progress)`` on the worker; ``out`` is the KV buffer on the model device.

        The compute stream's work queued so far (e.g. ``out``'s zero fill) happens before the copies.
        """
        stream = self._stream
        compute = torch.cuda.current_stream(self._device) if stream is not None else None
        if stream is not None:
            out.record_stream(stream)  # the allocator must not hand the buffer out again before the copies finish
        progress = _LayerProgress(stream)

        def run() -> _Loaded:
            started_s = time.perf_counter()
            try:
                with torch.inference_mode():
                    if stream is None:
                        result = retrieve(out, progress)
                        return _Loaded(result, None, None, (time.perf_counter() - started_s) * 1e3)
                    assert compute is not None
                    with torch.cuda.stream(stream):
                        stream.wait_stream(compute)
                        started = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                        started.record(stream)
                        result = retrieve(out, progress)
                        finished = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                        finished.record(stream)
                    return _Loaded(result, started, finished, (time.perf_counter() - started_s) * 1e3)
            finally:
                progress.end()

        return PendingLoad(self._executor.submit(run), progress, self._device)

    def close(self) -> None:
        """Finish the retrieve in flight (if any) and join the worker. Idempotent."""
        self._executor.shutdown(wait=True)
