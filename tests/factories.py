"""Factories for test inputs: real tensors of random values (never zeros, so unwritten memory shows)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import lmdb
import numpy as np
import numpy.typing as npt
import torch

from kvstore.config import StoreConfig
from kvstore.keys import PrefixKey
from kvstore.layout import KVLayout
from kvstore.tiers.base import TierName
from kvstore.tiers.disk.format import frame_key


def make_kv(layout: KVLayout, num_tokens: int, seed: int = 0) -> torch.Tensor:
    """Random KV of ``num_tokens`` tokens in the layout's shape and dtype."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(layout.chunk_shape(num_tokens), generator=generator)
    return values.to(layout.dtype.torch_dtype)


def make_tokens(num_tokens: int, seed: int = 0) -> npt.NDArray[np.int64]:
    """Random token ids below a typical vocabulary size."""
    return np.random.default_rng(seed).integers(0, 50_000, size=num_tokens, dtype=np.int64)


def run_in_threads(worker: Callable[[int], None], num_threads: int) -> None:
    """Run ``worker(0..num_threads-1)`` on that many threads at once and wait for all of them."""
    threads = [threading.Thread(target=worker, args=(index,)) for index in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


@contextlib.contextmanager
def edit_payload(path: Path) -> Iterator[tuple[lmdb.Transaction, lmdb._Database]]:
    """A write transaction on a closed data dir's frames, behind the tier's back (to plant defects)."""
    env = lmdb.open(str(path), max_dbs=8)
    try:
        with env.begin(write=True) as txn:
            yield txn, env.open_db(b"payload", txn=txn)
    finally:
        env.close()


def flip_frame_bit(path: Path, key: PrefixKey, frame_index: int = 0) -> None:
    """Flip one bit in the middle of a stored chunk's frame, behind the tier's back (its checksum must catch it)."""
    with edit_payload(path) as (txn, db):
        stored = txn.get(frame_key(key, frame_index), db=db)
        assert stored is not None, f"no frame {frame_index} of {key.hex()}"
        frame = bytearray(stored)
        frame[len(frame) // 2] ^= 0x40
        txn.put(frame_key(key, frame_index), bytes(frame), db=db)


def store_config(
    tmp_path: Path, layout: KVLayout, chunk_size: int, *, gpu_chunks: int, cpu_chunks: int, **changes: object
) -> StoreConfig:
    """All three tiers sized in chunks (the gpu tier's logic on host memory), data under ``tmp_path/data``."""
    chunk_bytes = layout.chunk_bytes(chunk_size)
    settings: dict[str, object] = {
        "tiers": (TierName.GPU, TierName.CPU, TierName.DISK),
        "chunk_size": chunk_size,
        "gpu_capacity_bytes": gpu_chunks * chunk_bytes,
        "gpu_device": "cpu",
        "cpu_capacity_bytes": cpu_chunks * chunk_bytes,
        "data_dir": tmp_path / "data",
        "disk_capacity_bytes": 64 << 20,
    }
    return StoreConfig(**{**settings, **changes})  # type: ignore[arg-type]
