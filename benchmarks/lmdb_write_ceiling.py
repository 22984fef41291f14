"""How fast plain LMDB writes on this machine, against a raw sequential write of the same bytes in the same run.

The disk tier's put must go through LMDB (one writer, ``writemap=False``, ``sync=False``, a sync at the end). This
measures that path with nothing of kvstore around it -- incompressible values of one frame's size, one per write
transaction (the tier's shape), then ``env.sync`` -- so a disk put below its target can be told apart: LMDB itself
(this ratio low too) or the work around it (codec, copies; this ratio near 1). Variants: several values per
transaction, and ``writemap=True``. Every run writes a fresh file in a fresh directory; raw write and LMDB variants
alternate repeat by repeat.

One JSON object per variant on stdout: ``variant, GBps, baseline_GBps, ratio, cpu_cores`` (medians; ``cpu_cores``
is process CPU time over wall time).

Usage::

    .venv/bin/python benchmarks/lmdb_write_ceiling.py [--total-mib 1024] [--value-kib 2048] [--repeats 3] \
        [--scratch-dir D]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import lmdb
import numpy as np

_MAP_BYTES = 1 << 40  # address space only: with writemap=False the file grows as pages are written


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _raw_write(path: Path, values: list[memoryview], count: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for index in range(count):
            view, written = values[index % len(values)], 0
            while written < len(view):
                written += os.write(fd, view[written:])
        os.fsync(fd)
    finally:
        os.close(fd)


def _lmdb_write(path: Path, values: list[memoryview], count: int, *, per_txn: int, writemap: bool) -> None:
    env = lmdb.open(str(path), map_size=_MAP_BYTES, sync=False, metasync=False, writemap=writemap, max_dbs=1)
    try:
        index = 0
        while index < count:
            with env.begin(write=True) as txn:
                for _ in range(min(per_txn, count - index)):
                    txn.put(index.to_bytes(8, "big"), values[index % len(values)])
                    index += 1
        env.sync(True)
    finally:
        env.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total-mib", type=int, default=1024, help="bytes written per run, in MiB")
    parser.add_argument("--value-kib", type=int, default=2048, help="bytes per value (the tier's frames: 1-4 MiB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scratch-dir", type=Path, default=None, help="parent of the temp dir (default: cwd)")
    args = parser.parse_args()
    value_bytes = args.value_kib << 10
    count = max(1, (args.total_mib << 20) // value_bytes)
    total_bytes = count * value_bytes
    random_bytes = np.random.default_rng(0).integers(0, 256, 4 * value_bytes, dtype=np.uint8).tobytes()
    values = [memoryview(random_bytes)[i * value_bytes : (i + 1) * value_bytes] for i in range(4)]
    variants: dict[str, Callable[[Path], None]] = {
        "raw write + fsync": lambda path: _raw_write(path / "raw.bin", values, count),
        "lmdb, 1 value per txn": lambda path: _lmdb_write(path, values, count, per_txn=1, writemap=False),
        "lmdb, 4 values per txn": lambda path: _lmdb_write(path, values, count, per_txn=4, writemap=False),
        "lmdb, 1 value per txn, writemap": lambda path: _lmdb_write(path, values, count, per_txn=1, writemap=True),
    }
    gbps: dict[str, list[float]] = {name: [] for name in variants}
    cores: dict[str, list[float]] = {name: [] for name in variants}
    root = Path(tempfile.mkdtemp(prefix="lmdb-ceiling-", dir=args.scratch_dir or Path.cwd()))
    try:
        for repeat in range(args.repeats):
            for index, (name, write) in enumerate(variants.items()):
                path = root / f"{repeat}-{index}"
                path.mkdir()
                cpu_start, start = _cpu_s(), time.perf_counter()
                write(path)
                seconds = time.perf_counter() - start
                gbps[name].append(total_bytes / seconds / 1e9)
                cores[name].append((_cpu_s() - cpu_start) / seconds)
                shutil.rmtree(path)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    baseline = statistics.median(gbps["raw write + fsync"])
    for name in variants:
        median = statistics.median(gbps[name])
        row = {
            "variant": name,
            "GBps": round(median, 3),
            "baseline_GBps": round(baseline, 3),
            "ratio": round(median / baseline, 3),
            "cpu_cores": round(statistics.median(cores[name]), 2),
            "value_bytes": value_bytes,
            "total_bytes": total_bytes,
            "repeats": args.repeats,
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
