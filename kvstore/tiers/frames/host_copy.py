"""Copies between host tensors on the calling thread, without torch's OpenMP threads.

``Tensor.copy_`` splits a copy of a few MiB over torch's OpenMP threads, and libgomp's workers then busy-wait for
the next parallel region. In a store that copies a chunk at a time, next to codec threads that need the cores, that
spinning costs more than the parallel copy gains: on the 2-core dev machine it took CPU time from the disk tier's codec
threads and held its put under target; on the 16-core H200 host the disk put went from below to above the speed of a raw
write once the staging copy stopped using it (measured: docs/design-notes.md#tiers-frames-host-copy). A single-threaded
copy of a chunk already runs at memory bandwidth.

Used for the disk tier's staging copy. The memory tiers keep ``Tensor.copy_``: with torch on one thread (how
``kvstore bench tiers`` measures them) a numpy or ``memmove`` copy ran slower than ``copy_`` there (in that
bench no codec thread competes with them; in a store writing through to disk one may).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["copy_tensor"]

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy_tensor(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; done by numpy on the calling thread when both are host tensors of one dtype and shape.

    The host path copies the bits (any strides, NaN payloads and -0.0 included). Anything else -- a device on either
    side (a DMA), a dtype conversion, broadcasting -- is ``Tensor.copy_``'s.
    """
    as_int = _SAME_SIZE_INT.get(src.element_size())
    if (
        as_int is None
        or dst.device.type != "cpu"
        or src.device.type != "cpu"
        or dst.dtype != src.dtype
        or dst.shape != src.shape
    ):
        dst.copy_(src)
        return
    np.copyto(dst.detach().view(as_int).numpy(), src.detach().view(as_int).numpy())
