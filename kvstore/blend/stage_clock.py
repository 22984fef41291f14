"""Timing the stages of a prefill truthfully on the CPU and on a GPU.

On a GPU, kernels run after the host has queued them, so host timestamps around a stage measure the queueing, not
the work. ``StageClock`` marks the compute stream with CUDA events instead (``between`` reads them once the stream
has been synchronised, at the end of the prefill); on the CPU a mark is a ``perf_counter`` reading. Either way
``between(a, b)`` is the time the device spent from mark ``a`` to mark ``b``, including any time it sat idle
waiting (which is how a wait for loaded KV shows up as load time).

Used by one prefill at a time on one thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

__all__ = ["Mark", "StageClock"]


@dataclass(frozen=True, slots=True)
class Mark:
    """A point on the compute stream: a CUDA event, or a host time in seconds."""

    event: torch.cuda.Event | None
    host_s: float


class StageClock:
    """Marks on the compute stream of ``device``.

    Args:
        device: the model's device; CUDA devices are marked with events.
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._device = device

    def mark(self) -> Mark:
        """Record a point on the current stream (or read the host clock)."""
        if not self._cuda:
            return Mark(None, time.perf_counter())
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self._device))
        return Mark(event, time.perf_counter())

    def synchronize(self) -> None:
        """Wait until the device has run everything queued so far (a no-op on the CPU)."""
        if self._cuda:
            torch.cuda.synchronize(self._device)

    def between(self, start: Mark, end: Mark) -> float:
        """Milliseconds from ``start`` to ``end`` on the device; call ``synchronize`` first on CUDA."""
        if start.event is not None and end.event is not None:
            return float(start.event.elapsed_time(end.event))
        return (end.host_s - start.host_s) * 1e3
