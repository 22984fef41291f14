"""A/B of the disk tier's frame size on cold gets: fixed 4 MiB frames against equal frames (the default).

Run: .venv/bin/python benchmarks/ab_frame_bytes.py [--layout smollm2-135m] [--chunks 100] [--repeats 3]
Both variants write the same chunks, flush, drop data.mdb from the page cache, reopen read-only and read every
chunk; they alternate repeat by repeat. Prints GB/s of uncompressed KV per repeat and the median.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kvstore.keys import as_token_array, prefix_keys
from kvstore.presets import preset_layout
from kvstore.tiers.base import ChunkRecord
from kvstore.tiers.disk.tier import DiskTier

CHUNK_SIZE = 256


def cold_get_gbps(layout_name: str, num_chunks: int, frame_bytes: int | None, parent: Path) -> float:
    layout = preset_layout(layout_name)
    tokens = as_token_array(np.random.default_rng(0).integers(0, 50_000, size=num_chunks * CHUNK_SIZE))
    keys = prefix_keys(layout.namespace, tokens, CHUNK_SIZE)
    scales = torch.exp(torch.randn(1, 1, 1, layout.num_kv_heads, layout.head_dim))
    sources = [(torch.randn(layout.chunk_shape(CHUNK_SIZE)) * scales).to(torch.bfloat16) for _ in range(4)]
    path = Path(tempfile.mkdtemp(dir=parent)) / "data"
    try:
        tier = DiskTier(path, layout, CHUNK_SIZE, 4 << 30, frame_bytes=frame_bytes)
        for index, key in enumerate(keys):
            chunk_tokens = tokens[index * CHUNK_SIZE : (index + 1) * CHUNK_SIZE]
            tier.put(ChunkRecord(key=key, source_start=index * CHUNK_SIZE, tokens=chunk_tokens), sources[index % 4])
        tier.close()
        os.sync()
        descriptor = os.open(path / "data.mdb", os.O_RDONLY)
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(descriptor)
        tier = DiskTier(path, layout, CHUNK_SIZE, 4 << 30, frame_bytes=frame_bytes, read_only=True)
        out = torch.empty(layout.chunk_shape(CHUNK_SIZE), dtype=torch.bfloat16)
        started = time.perf_counter()
        for key in keys:
            assert tier.get_into(key, out)
        elapsed = time.perf_counter() - started
        tier.close()
        return num_chunks * layout.chunk_bytes(CHUNK_SIZE) / elapsed / 1e9
    finally:
        shutil.rmtree(path.parent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", default="smollm2-135m")
    parser.add_argument("--chunks", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scratch-dir", type=Path, default=Path.cwd())
    args = parser.parse_args()
    results: dict[str, list[float]] = {"4 MiB frames": [], "equal frames (default)": []}
    for _ in range(args.repeats):
        results["4 MiB frames"].append(cold_get_gbps(args.layout, args.chunks, 4 << 20, args.scratch_dir))
        results["equal frames (default)"].append(cold_get_gbps(args.layout, args.chunks, None, args.scratch_dir))
    for name, samples in results.items():
        print(f"{name}: {[round(s, 2) for s in samples]} GB/s, median {statistics.median(samples):.2f}")


if __name__ == "__main__":
    main()
