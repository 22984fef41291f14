"""A write storm in its own process, for the kill -9 test: ``python -m tests.integration.storm_writer DIR``.

Stores sequence after sequence (each fully determined by its seed, see ``sequence``), flushes every few, and
prints ``durable N`` once every sequence below N is committed and synced. It runs until it is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from kvstore import KVLayout, StoreConfig, TieredStore
from kvstore.tiers.base import TierName

LAYOUT = KVLayout(model_id="test/storm", num_layers=4, num_kv_heads=2, head_dim=64)
CHUNK_SIZE = 32
TOKENS_PER_SEQUENCE = 80  # two full chunks and a partial one
REPO_ROOT = Path(__file__).resolve().parents[2]


def sequence(seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """Tokens and KV of sequence ``seed``; the first token is the seed, so a chunk names its sequence."""
    tokens = np.random.default_rng(seed).integers(0, 50_000, size=TOKENS_PER_SEQUENCE)
    tokens[0] = seed
    kv = torch.randn(LAYOUT.chunk_shape(TOKENS_PER_SEQUENCE), generator=torch.Generator().manual_seed(seed))
    return tokens, kv.to(torch.bfloat16)


def config(path: Path) -> StoreConfig:
    return StoreConfig(
        tiers=(TierName.CPU, TierName.DISK),
        chunk_size=CHUNK_SIZE,
        cpu_capacity_bytes=64 * LAYOUT.chunk_bytes(CHUNK_SIZE),
        data_dir=path,
        disk_capacity_bytes=1 << 30,
    )


def storm_and_kill(data: Path, durable_target: int, linger_s: float = 0.0, timeout_s: float = 120.0) -> int:
    """Run a storm writer on ``data`` in a child process, SIGKILL it once ``durable_target`` sequences are
    acknowledged durable (and ``linger_s`` later: not always right after a flush); returns how many were."""
    durable = 0
    with subprocess.Popen(
        [sys.executable, "-m", "tests.integration.storm_writer", str(data)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    ) as writer:
        assert writer.stdout is not None
        deadline = time.monotonic() + timeout_s
        while durable < durable_target and time.monotonic() < deadline:
            line = writer.stdout.readline()
            if line.startswith("durable "):
                durable = int(line.split()[1])
        time.sleep(linger_s)
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
    return durable


def main() -> None:
    with TieredStore(LAYOUT, config(Path(sys.argv[1]))) as store:
        seed = 0
        while True:
            store.store(*sequence(seed))
            seed += 1
            if seed % 8 == 0:
                store.flush()
                print(f"durable {seed}", flush=True)


if __name__ == "__main__":
    main()
