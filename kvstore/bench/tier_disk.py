"""The disk tier's rows of ``kvstore bench tiers``: put, cold get and cold prefetched get against raw file I/O.

Each repeat writes every chunk through a fresh ``DiskTier`` (then ``flush``) and a sequential write of the same
bytes, then reads the chunks back from a dropped page cache through a reopened tier, once by one caller
(``get_cold``) and once by as many concurrent callers as the store's ``Prefetcher`` runs (``get_cold_prefetch``),
each beside a ``readinto`` of a dropped file of the same size. The baselines, targets and row fields are described
in ``kvstore.bench.tiers``, which runs this module only when the disk tier is asked for (the memory tiers run
where LMDB and zstandard are absent) and whose timing and row helpers it uses.

Threads: the caller's, but for ``get_cold_prefetch``'s readers (a pool joined before its figures are read); the
disk tier runs its own workers. Logs; never prints.
"""

from __future__ import annotations

import concurrent.futures
import os
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvstore.bench.page_cache import drop_page_cache
from kvstore.bench.tier_options import TierBenchOptions
from kvstore.bench.tiers import _CPU, Op, TierBenchRow, _bits_equal, _Case, _row, _Samples, _time_ops
from kvstore.store.prefetch import DEFAULT_PREFETCH_THREADS
from kvstore.tiers.base import TierName
from kvstore.tiers.disk.tier import DiskTier

__all__ = ["bench_disk"]

_MIB = 1024 * 1024
_READ_BYTES = 4 * _MIB
_TARGET_DISK_PUT_RATIO = 0.6
_TARGET_DISK_GET_RATIO = 1.0
_READ_BASELINE = "4 MiB readinto, dropped page cache"


def bench_disk(options: TierBenchOptions, case: _Case, say: Callable[[str], None]) -> Iterator[TierBenchRow]:
    """The disk tier's ``put``, ``get_cold`` and ``get_cold_prefetch`` rows, over ``options.num_disk_repeats``
    repeats in a temporary directory under ``options.directory`` (removed afterwards)."""
    run = _DiskRun(options, case)
    if options.directory is not None:
        options.directory.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="kvstore-bench-", dir=options.directory))
    # Both timed writes start right after a just-written file of the same size was deleted: on the shared
    # virtual disk a write right behind another one ran much slower than one behind a delete (measured:
    # docs/design-notes.md#bench-tiers).
    try:
        _raw_write(root / "warm-up.bin", case)
        (root / "warm-up.bin").unlink()
        for repeat in range(options.num_disk_repeats):
            say(f"{case.name}: disk tier, repeat {repeat + 1}/{options.num_disk_repeats}")
            data_dir = root / f"tier-{repeat}"  # holds the baseline file too: same directory, same disk area
            data_dir.mkdir()
            run.measure_repeat(data_dir)
            shutil.rmtree(data_dir)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    yield from run.rows()


@dataclass(slots=True)
class _DiskSamples:
    """Every figure of the disk tier's repeats and whether each check held in all of them; owned by one run."""

    put: _Samples = field(default_factory=_Samples)
    put_base: _Samples = field(default_factory=_Samples)
    get: _Samples = field(default_factory=_Samples)
    get_prefetch: _Samples = field(default_factory=_Samples)
    get_base: _Samples = field(default_factory=_Samples)
    compression_ratios: list[float] = field(default_factory=list)
    committed: bool = True
    verified: bool = True
    verified_prefetch: bool = True


class _DiskRun:
    """One layout's disk measurement: the read buffers, the tier's settings and the samples of every repeat."""

    def __init__(self, options: TierBenchOptions, case: _Case) -> None:
        self._options = options
        self._case = case
        self._outs = [torch.empty_like(source) for source in case.sources]
        self._read_buffer = self._outs[0].view(torch.uint8).reshape(-1).numpy().data
        self._capacity_bytes = 2 * case.total_bytes + 64 * _MIB  # nothing is evicted during the run
        self._samples = _DiskSamples()

    def measure_repeat(self, data_dir: Path) -> None:
        """One repeat in ``data_dir``: write baseline, tier put, serial cold get, read baseline, prefetched cold
        get, read baseline again (each read right after the one it is compared with)."""
        case, samples = self._case, self._samples
        raw_path = data_dir / "baseline.bin"
        with _cpu_meter(samples.put_base, case.total_bytes):
            samples.put_base.gbps.append(case.total_bytes / _raw_write(raw_path, case) / 1e9)
        raw_path.unlink()
        self._put_all(data_dir)
        samples.verified = self._cold_get(data_dir, samples.get, self._serial_reads) and samples.verified
        _raw_write(raw_path, case)  # untimed: the read baseline's file, just written like the tier's data
        self._time_raw_read(raw_path)
        samples.verified_prefetch = (
            self._cold_get(data_dir, samples.get_prefetch, self._prefetch_reads) and samples.verified_prefetch
        )
        self._time_raw_read(raw_path)  # a second baseline sample, right after the second read

    def _open_tier(self, data_dir: Path, *, read_only: bool) -> DiskTier:
        return DiskTier(
            data_dir,
            self._case.layout,
            self._options.chunk_size,
            self._capacity_bytes,
            zstd_level=self._options.zstd_level,
            num_codec_threads=self._options.num_codec_threads,
            read_only=read_only,
        )

    def _put_all(self, data_dir: Path) -> None:
        """Put every chunk through a fresh tier, then flush: the timed put, and whether every chunk committed."""
        case, samples = self._case, self._samples
        records, put = case.records, samples.put
        writer = self._open_tier(data_dir, read_only=False)
        try:
            with _cpu_meter(put, case.total_bytes):
                start_s = time.perf_counter()
                put.num_failed_ops += sum(not writer.put(r, case.source(i)) for i, r in enumerate(records))
                writer.flush()
                put.gbps.append(case.total_bytes / (time.perf_counter() - start_s) / 1e9)
            stats = writer.stats()  # a put only queues: a write that failed later shows here
            samples.committed = samples.committed and stats.num_chunks == len(records) and stats.puts >= len(records)
            samples.compression_ratios.append(stats.compression_ratio)
        finally:
            writer.close()

    def _time_raw_read(self, raw_path: Path) -> None:
        get_base, total_bytes = self._samples.get_base, self._case.total_bytes
        with _cpu_meter(get_base, total_bytes):
            get_base.gbps.append(total_bytes / _raw_read(raw_path, self._read_buffer) / 1e9)

    def _serial_reads(self, op: Op, samples: _Samples) -> None:
        _time_ops(op, len(self._case.records), self._case.total_bytes, _CPU, samples)

    def _prefetch_reads(self, op: Op, samples: _Samples) -> None:
        _time_concurrent_ops(op, len(self._case.records), self._case.total_bytes, DEFAULT_PREFETCH_THREADS, samples)

    def _cold_get(self, data_dir: Path, samples: _Samples, read_all: Callable[[Op, _Samples], None]) -> bool:
        """Read every chunk back from a dropped page cache through a reopened tier; whether the bytes match."""
        records, outs = self._case.records, self._outs
        drop_page_cache(data_dir)
        reader = self._open_tier(data_dir, read_only=True)
        try:
            drop_page_cache(data_dir)  # again: opening may have read some pages
            for out in outs:
                out.zero_()
            get_into = reader.get_into
            # Chunks i and i + len(outs) share a buffer and a source: concurrent readers write the same bytes.
            with _cpu_meter(samples, self._case.total_bytes):
                read_all(lambda i: bool(get_into(records[i].key, outs[i % len(outs)])), samples)
        finally:
            reader.close()
        return all(map(_bits_equal, outs, self._case.sources))

    def rows(self) -> Iterator[TierBenchRow]:
        """The three rows, from the samples of every repeat."""
        case, options, samples = self._case, self._options, self._samples
        ratio, codec = statistics.median(samples.compression_ratios), f"zstd {options.zstd_level}"
        codec += f", {options.num_codec_threads} codec threads"
        yield _row(
            case,
            TierName.DISK,
            "put",
            samples.put,
            ("sequential write, fsync", samples.put_base),
            _TARGET_DISK_PUT_RATIO,
            note=f"all chunks put, then flush (codec, commit, sync); {codec}",
            verified=samples.committed,
            compression_ratio=ratio,
        )
        yield _row(
            case,
            TierName.DISK,
            "get_cold",
            samples.get,
            (_READ_BASELINE, samples.get_base),
            _TARGET_DISK_GET_RATIO,
            note=f"files dropped (POSIX_FADV_DONTNEED), tier reopened; {codec}",
            verified=samples.verified,
            compression_ratio=ratio,
        )
        yield _row(
            case,
            TierName.DISK,
            "get_cold_prefetch",
            samples.get_prefetch,
            (_READ_BASELINE, samples.get_base),
            _TARGET_DISK_GET_RATIO,
            note=f"as get_cold, {DEFAULT_PREFETCH_THREADS} concurrent readers (the store's prefetcher); {codec}",
            verified=samples.verified_prefetch,
            compression_ratio=ratio,
        )


def _time_concurrent_ops(op: Op, num_ops: int, num_bytes: int, num_threads: int, samples: _Samples) -> None:
    """Run ``op(0) .. op(num_ops - 1)`` on ``num_threads`` threads, taken in order, into ``samples``.

    GB/s are over the wall time of the whole set; per-op latency is each call's own wall time.
    """
    clock_ns = time.perf_counter_ns

    def timed(index: int) -> tuple[bool, int]:
        start_ns = clock_ns()
        done = op(index)
        return done, clock_ns() - start_ns

    with concurrent.futures.ThreadPoolExecutor(num_threads, thread_name_prefix="kvstore-bench-read") as pool:
        start_ns = clock_ns()
        outcomes = list(pool.map(timed, range(num_ops)))
        elapsed_ns = clock_ns() - start_ns
    samples.gbps.append(num_bytes / elapsed_ns)
    samples.num_failed_ops += sum(not done for done, _ in outcomes)
    samples.op_ms.extend(op_ns / 1e6 for _, op_ns in outcomes)


def _process_cpu_s() -> tuple[float, float]:
    """User and system CPU seconds this process has used so far, every thread."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


@contextmanager
def _cpu_meter(samples: _Samples, num_bytes: int) -> Iterator[None]:
    """Append to ``samples`` the cores the block kept busy (process CPU time over its wall time) and its user and
    system CPU seconds per GB of ``num_bytes``."""
    (user_start_s, sys_start_s), wall_start_s = _process_cpu_s(), time.perf_counter()
    yield
    wall_s, (user_end_s, sys_end_s) = time.perf_counter() - wall_start_s, _process_cpu_s()
    user_s, sys_s = user_end_s - user_start_s, sys_end_s - sys_start_s
    samples.cpu_cores.append((user_s + sys_s) / wall_s)
    samples.user_s_per_gb.append(user_s / (num_bytes / 1e9))
    samples.sys_s_per_gb.append(sys_s / (num_bytes / 1e9))


def _raw_write(path: Path, case: _Case) -> float:
    """Seconds to write every chunk's source bytes sequentially, then fsync: the disk put baseline."""
    views = [source.view(torch.uint8).reshape(-1).numpy().data for source in case.sources]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        start_s = time.perf_counter()
        for i in range(len(case.records)):
            view, written = views[i % len(views)], 0
            while written < len(view):
                written += os.write(fd, view[written:])
        os.fsync(fd)
        return time.perf_counter() - start_s
    finally:
        os.close(fd)


def _raw_read(path: Path, buffer: memoryview) -> float:
    """Seconds to read ``path`` from a cold page cache into ``buffer`` (wrapping), 4 MiB per ``readinto``."""
    drop_page_cache(path.parent)
    with open(path, "rb", buffering=0) as file:
        start_s = time.perf_counter()
        offset = 0
        while count := file.readinto(buffer[offset : offset + _READ_BYTES]):
            offset = (offset + count) % len(buffer)
        return time.perf_counter() - start_s
