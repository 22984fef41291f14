"""Reusable host buffers for the disk tier's ``put``: a bounded pool, so a burst of puts meets backpressure.

``DiskTier.put`` copies the caller's tensor (any device, any strides) into a staging buffer and returns; the
disk writer releases the buffer after the chunk is committed. Buffers are allocated on first need and then
reused: a fresh 32 MiB allocation copies up to 7x slower than a reused one (limits.md), and a bounded pool
keeps a burst of puts from growing memory -- when every buffer is in flight, ``acquire`` blocks until the
writer frees one.

Threads: callers ``acquire``, the disk writer ``release``; ``_cond`` guards ``_free`` and ``_num_allocated``.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["StagingPool"]


class StagingPool:
    """At most ``max_buffers`` host buffers of ``buffer_bytes`` each, allocated on first need, then reused."""

    def __init__(self, buffer_bytes: int, max_buffers: int) -> None:
        self.buffer_bytes = buffer_bytes
        self.max_buffers = max_buffers
        self._cond = threading.Condition()
        self._free: list[torch.Tensor] = []
        self._num_allocated = 0

    def acquire(self) -> torch.Tensor:
        """A free buffer (uint8, ``buffer_bytes`` long); blocks while all are in flight."""
        with self._cond:
            while not self._free and self._num_allocated >= self.max_buffers:
                self._cond.wait()
            if self._free:
                return self._free.pop()
            self._num_allocated += 1
        return torch.empty(self.buffer_bytes, dtype=torch.uint8)

    def release(self, buffer: torch.Tensor) -> None:
        """Hand a buffer back once nothing reads it any more."""
        with self._cond:
            self._free.append(buffer)
            self._cond.notify()
