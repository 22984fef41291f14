"""StagingPool: a bounded pool of host buffers, allocated up front (every page touched) or on first need."""

from __future__ import annotations

import threading

import torch

from kvstore.tiers.disk.staging import StagingPool


def test_a_preallocated_pool_holds_every_buffer_from_the_start() -> None:
    pool = StagingPool(4096, 3, preallocate=True)
    assert pool.num_allocated == 3
    buffers = [pool.acquire() for _ in range(3)]
    assert pool.num_allocated == 3
    assert all(buffer.dtype == torch.uint8 and buffer.numel() == 4096 for buffer in buffers)
    assert len({buffer.data_ptr() for buffer in buffers}) == 3
    assert all(int(buffer.count_nonzero()) == 0 for buffer in buffers)  # written once at creation


def test_a_lazy_pool_allocates_on_first_need_and_then_reuses() -> None:
    pool = StagingPool(4096, 3)
    assert pool.num_allocated == 0
    first = pool.acquire()
    assert pool.num_allocated == 1
    pool.release(first)
    assert pool.acquire().data_ptr() == first.data_ptr()
    assert pool.num_allocated == 1


def test_acquire_blocks_while_every_buffer_is_in_flight() -> None:
    pool = StagingPool(1024, 2, preallocate=True)
    held = [pool.acquire(), pool.acquire()]
    got: list[torch.Tensor] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire()))
    waiter.start()
    waiter.join(timeout=0.2)
    assert waiter.is_alive() and not got  # no third buffer: backpressure
    pool.release(held[0])
    waiter.join(timeout=5)
    assert got and got[0].data_ptr() == held[0].data_ptr()
    assert pool.num_allocated == 2
