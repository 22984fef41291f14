"""How much a plain buffered write costs on this machine when the page cache must grow, against when it recycles.

The disk tier's put spends a quarter of its CPU samples in the kernel's copy into page-cache pages
(``copy_folio_from_iter_atomic``), and its system time swings several-fold between runs of identical work. On a
virtual machine whose guest memory the host backs lazily (a balloon with free page reporting), a page the guest
has not used lately costs a host fault on first touch. This measures that effect with nothing of kvstore around
it: the same sequential write of ``--total-mib`` (then ``fsync``) in two modes, alternating repeat by repeat:

- ``recycled``: the previous file of this mode is deleted first, so the write can reuse pages just freed;
- ``growing``: every file of this mode is kept until the end, so each write needs page-cache memory the process
  has not touched before (the cache grows by ``--total-mib`` per repeat; size ``--repeats`` to the free memory).

One JSON object per write on stdout: ``mode, repeat, GBps, sys_core_s_per_GB, user_core_s_per_GB``, then one per
mode with the medians. Every byte counts once (10^9 bytes per GB).

Usage::

    .venv/bin/python benchmarks/page_cache_write.py [--total-mib 768] [--repeats 5] [--scratch-dir D]
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
from pathlib import Path

import numpy as np

_BLOCK_BYTES = 64 * 1024 * 1024
_MODES = ("recycled", "growing")


def _write_file(path: Path, block: memoryview, total_bytes: int) -> tuple[float, float, float]:
    """Write ``total_bytes`` (``block`` repeated) to a new file, then ``fsync``: (wall, user, sys) seconds."""
    before, start_s = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        written = 0
        while written < total_bytes:
            written += os.write(fd, block[: total_bytes - written])
        os.fsync(fd)
    finally:
        os.close(fd)
    wall_s, after = time.perf_counter() - start_s, resource.getrusage(resource.RUSAGE_SELF)
    return wall_s, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total-mib", type=int, default=768, help="bytes per write, MiB")
    parser.add_argument("--repeats", type=int, default=5, help="writes per mode")
    parser.add_argument("--scratch-dir", type=Path, default=None, help="parent of the temporary directory")
    args = parser.parse_args()
    if args.total_mib <= 0 or args.repeats <= 0:
        parser.error("--total-mib and --repeats must be positive")
    total_bytes = args.total_mib * 1024 * 1024
    block = np.random.default_rng(0).integers(0, 256, size=_BLOCK_BYTES, dtype=np.uint8).data
    root = Path(tempfile.mkdtemp(prefix="kvstore-page-cache-", dir=args.scratch_dir))
    rows: dict[str, list[dict[str, float | int | str]]] = {mode: [] for mode in _MODES}
    try:
        previous_recycled: Path | None = None
        for repeat in range(args.repeats):
            for mode in _MODES:
                path = root / f"{mode}-{repeat}.bin"
                if mode == "recycled" and previous_recycled is not None:
                    previous_recycled.unlink()
                wall_s, user_s, sys_s = _write_file(path, block, total_bytes)
                if mode == "recycled":
                    previous_recycled = path
                gigabytes = total_bytes / 1e9
                row: dict[str, float | int | str] = {
                    "mode": mode,
                    "repeat": repeat,
                    "GBps": round(gigabytes / wall_s, 3),
                    "sys_core_s_per_GB": round(sys_s / gigabytes, 3),
                    "user_core_s_per_GB": round(user_s / gigabytes, 3),
                }
                rows[mode].append(row)
                print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for mode in _MODES:
        summary: dict[str, float | str] = {"mode": mode, "summary": "median"}
        for field in ("GBps", "sys_core_s_per_GB", "user_core_s_per_GB"):
            summary[field] = statistics.median(float(row[field]) for row in rows[mode])
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
