"""Reusable host buffers for the disk tier's ``put``: a bounded pool, so a burst of puts meets backpressure.

``DiskTier.put`` copies the caller's tensor (any device, any strides) into a staging buffer and returns; the
disk writer releases the buffer after the chunk is committed. Buffers are reused: a fresh 32 MiB allocation
copies several times slower than a reused one (docs/design-notes.md), and a bounded pool keeps a burst of puts
from growing memory -- when every buffer is in flight, ``acquire`` blocks until the writer frees one.

With ``preallocate`` every buffer is allocated and each of its pages written once when the pool is made, so
no put pays for first touches (page faults, and on a VM whose host backs guest memory lazily a host fault
too); otherwise buffers are allocated on first need, which suits a tier whose puts are rare.

Threads: callers ``acquire``, the disk writer ``release``; ``_cond`` guards ``_free`` and ``_num_allocated``.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

__all__ = ["StagingPool"]


class StagingPool:
    """At most ``max_buffers`` host buffers of ``buffer_bytes`` each, allocated up front or on first need."""

    def __init__(self, buffer_bytes: int, max_buffers: int, *, preallocate: bool = False) -> None:
        self.buffer_bytes = buffer_bytes
        self.max_buffers = max_buffers
        self._cond = threading.Condition()
        num_up_front = max_buffers if preallocate else 0
        self._free: list[torch.Tensor] = [_touched_buffer(buffer_bytes) for _ in range(num_up_front)]
        self._num_allocated = len(self._free)

    @property
    def num_allocated(self) -> int:
        """Buffers that exist now, free or in flight (``max_buffers`` from the start when preallocated)."""
        with self._cond:
            return self._num_allocated

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


def _touched_buffer(num_bytes: int) -> torch.Tensor:
    """A host buffer whose every page has been written once (numpy: one thread, no OpenMP workers left spinning)."""
    buffer = torch.empty(num_bytes, dtype=torch.uint8)
    np.asarray(buffer.numpy()).fill(0)
    return buffer
