"""Put and get bandwidth of each tier against a baseline moving the same bytes, measured in the same run.

One ``TierBenchRow`` per (tier, layout, op). GB/s are 1e9 bytes of uncompressed KV per second, each byte
counted once (a copy reads and writes it; tier and baseline alike). Figures are medians of timed repeats;
tier and baseline alternate repeat by repeat, so drift of the shared machine hits both. Baselines:

- cpu put/get: ``Tensor.copy_`` between preallocated host tensors; torch on 1 thread for tier and baseline.
- gpu put/get: device-to-device ``copy_``. Promotion cpu -> gpu (``gpu.put(record, cpu.view(key))``):
  pinned host-to-device ``copy_``, blocking, as ``GpuTier.put`` copies.
- disk put (every chunk ``put``, then ``flush``: codec, LMDB commit, sync): a sequential write of the same
  bytes from preallocated buffers to a file in the same directory, then ``fsync``.
- disk get, cold: the tier's files are dropped from the page cache (``POSIX_FADV_DONTNEED``) and the tier
  is reopened; baseline: ``readinto`` (4 MiB each) of a dropped file of the same uncompressed size. Measured
  twice: ``get_cold``, one caller reading chunk after chunk, and ``get_cold_prefetch``, the chunks read by as
  many concurrent callers as the store's ``Prefetcher`` runs (how a lookup's disk-only chunks are read).

The disk rows are measured in ``kvstore.bench.tier_disk``, imported only when the disk tier is asked for.

Reads land in zeroed buffers and are compared bit for bit with what was written, so a broken tier or codec
cannot post a good number. KV is random bf16 with log-normal per-channel scales; a few distinct chunks rotate.

Threads: all in the caller's thread (the disk tier runs its own workers), but for ``get_cold_prefetch``. The cpu
tier is measured with torch's intra-op threads set to 1; the previous count is restored. Logs; never prints.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from kvstore.bench.tier_options import TierBenchOptions
from kvstore.keys import as_token_array, prefix_keys
from kvstore.layout import KVLayout
from kvstore.presets import preset_layout
from kvstore.tiers.arena import ArenaTier
from kvstore.tiers.base import ChunkRecord, TierName
from kvstore.tiers.cpu import CpuTier
from kvstore.tiers.gpu import GpuTier

__all__ = ["TierBenchOptions", "TierBenchRow", "run_tier_benchmark"]

logger = logging.getLogger(__name__)

_CPU = torch.device("cpu")
_TARGET_MEMORY_RATIO = 0.7  # cpu and gpu put/get against copy_
_TARGET_PROMOTE_RATIO = 0.8  # cpu -> gpu against pinned host-to-device copy_

Op = Callable[[int], bool]
"""One timed operation on chunk ``i``; ``False`` when it failed (a miss or a rejected put)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TierBenchRow:
    """One measured (tier, layout, op): median GB/s, the same-run baseline, their ratio and its target.

    ``op`` is ``put``, ``get``, ``promote_from_cpu`` (gpu), ``get_cold`` or ``get_cold_prefetch`` (disk).
    Latencies are the caller's wall time per chunk, in ms, over every timed op of every repeat (for an
    asynchronous device copy: the time to queue it); ``None`` where a call is not one unit of work (queued disk
    puts).
    ``verified``: the bytes read back equal those written (get rows), every chunk is resident after the
    flush (disk put); ``None`` for memory-tier puts. ``met``: ratio at or above ``target_ratio`` and no
    failed verification. ``cpu_cores`` / ``baseline_cpu_cores`` (disk rows): the process's CPU time, every thread,
    user and system, over the wall time of the tier's operation and of its baseline -- how close each came to using
    every core, i.e. whether the machine's cores rather than its disk set the pace. ``user_core_s_per_GB`` /
    ``sys_core_s_per_GB`` (and their ``baseline_`` twins, disk rows): that CPU time split into user and system
    time, per GB: on a VM a cold read's user time varies widely between runs of identical work (docs/benchmarks.md;
    measured: docs/design-notes.md#bench-tiers).
    """

    tier: TierName
    layout: str
    op: str
    GBps: float
    baseline: str
    baseline_GBps: float
    ratio: float
    target_ratio: float
    met: bool
    num_chunks: int
    chunk_bytes: int
    num_repeats: int
    device: str
    compression_ratio: float | None = None
    cpu_cores: float | None = None
    baseline_cpu_cores: float | None = None
    user_core_s_per_GB: float | None = None
    sys_core_s_per_GB: float | None = None
    baseline_user_core_s_per_GB: float | None = None
    baseline_sys_core_s_per_GB: float | None = None
    verified: bool | None = None
    p50_ms: float | None = None
    p90_ms: float | None = None
    p99_ms: float | None = None
    max_ms: float | None = None
    note: str = ""

    def to_json_dict(self) -> dict[str, str | int | float | bool | None]:
        """Plain values for ``json.dumps``: one object per line in ``--json`` output."""
        values: dict[str, str | int | float | bool | None] = asdict(self)
        values["tier"] = self.tier.value
        return values


@dataclass(slots=True)
class _Samples:
    """GB/s of each timed repeat and ms of each timed op of one operation; owned by one measurement."""

    gbps: list[float] = field(default_factory=list)
    op_ms: list[float] = field(default_factory=list)
    cpu_cores: list[float] = field(default_factory=list)
    user_s_per_gb: list[float] = field(default_factory=list)
    sys_s_per_gb: list[float] = field(default_factory=list)
    num_failed_ops: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class _Case:
    """One layout's data: chunk records and the distinct host source chunks they rotate through."""

    name: str
    layout: KVLayout
    records: list[ChunkRecord]
    sources: list[torch.Tensor]
    chunk_bytes: int

    @property
    def total_bytes(self) -> int:
        return len(self.records) * self.chunk_bytes

    def source(self, index: int) -> torch.Tensor:
        return self.sources[index % len(self.sources)]


@dataclass(frozen=True, slots=True)
class _Timed:
    """An op to time, where its figures go, and untimed work to do before each of its repeats."""

    op: Op
    samples: _Samples
    prepare: Callable[[], object] | None = None


def run_tier_benchmark(
    options: TierBenchOptions, progress: Callable[[str], None] | None = None
) -> Iterator[TierBenchRow]:
    """Measure every requested (tier, layout, op), yielding each row as soon as it is measured.

    Args:
        options: what to measure and how much.
        progress: called with a one-line description of each step (for a progress display).

    Yields:
        Rows by layout, then tier (gpu, cpu, disk), then op.

    Raises:
        ConfigError: a tier cannot be built with these sizes (e.g. less than one chunk).
    """
    say = progress or (lambda _message: None)
    device = torch.device(options.device)
    run_gpu = TierName.GPU in options.tiers
    if run_gpu and device.type == "cuda" and not torch.cuda.is_available():
        logger.warning("gpu tier skipped: torch sees no CUDA device (device='cpu' runs its logic on host)")
        say("gpu tier skipped: no CUDA device")
        run_gpu = False
    for name in options.layouts:
        layout = preset_layout(name)
        if run_gpu:
            say(f"{name}: gpu tier on {device}")
            case = _make_case(options, name, layout, options.gpu_memory_bytes)
            yield from _bench_gpu(options, case, device)
        if TierName.CPU in options.tiers:
            say(f"{name}: cpu tier")
            yield from _bench_cpu(options, _make_case(options, name, layout, options.memory_bytes))
        if TierName.DISK in options.tiers:
            from kvstore.bench.tier_disk import bench_disk  # here: the memory tiers run without LMDB or zstandard

            yield from bench_disk(options, _make_case(options, name, layout, options.disk_bytes), say)


def _make_case(options: TierBenchOptions, name: str, layout: KVLayout, total_bytes: int) -> _Case:
    chunk_bytes = layout.chunk_bytes(options.chunk_size)
    num_chunks = max(1, total_bytes // chunk_bytes)
    num_sources = min(num_chunks, max(2, -(-options.source_bytes // chunk_bytes)))
    generator = torch.Generator().manual_seed(options.seed)
    shape = layout.chunk_shape(options.chunk_size)
    sources = []
    for _ in range(num_sources):  # K/V-like: channel magnitudes spread over ~2 orders of magnitude, no zeros
        scale = torch.exp(torch.randn((shape[0], shape[1], 1, shape[3], shape[4]), generator=generator))
        sources.append((torch.randn(shape, generator=generator) * scale).to(layout.dtype.torch_dtype))
    step = options.chunk_size
    rng = np.random.default_rng(options.seed)
    tokens = as_token_array(rng.integers(0, 50_000, size=num_chunks * step, dtype=np.int64))
    records = [
        ChunkRecord(key=key, source_start=i * step, tokens=tokens[i * step : (i + 1) * step])
        for i, key in enumerate(prefix_keys(layout.namespace, tokens, step))
    ]
    return _Case(name=name, layout=layout, records=records, sources=sources, chunk_bytes=chunk_bytes)


def _time_ops(op: Op, num_ops: int, num_bytes: int, device: torch.device, samples: _Samples | None) -> None:
    """Run ``op(0) .. op(num_ops - 1)`` back to back, into ``samples`` (``None``: an untimed warm-up).

    Per-op latency is the caller's wall time per call (a clock read is cheap; a CUDA event per op would cost more than a
    5.6 MiB device copy on the H200 host; measured: docs/design-notes.md#bench-tiers). On CUDA the loop is bracketed by
    synchronizes, so GB/s include the device work; an asynchronous copy's latency is its enqueue time.
    """
    cuda = device.type == "cuda"
    stamps_ns = [0] * (num_ops + 1)
    if cuda:
        torch.cuda.synchronize(device)
    failed = 0
    clock_ns = time.perf_counter_ns
    for index in range(num_ops):
        stamps_ns[index] = clock_ns()
        failed += not op(index)
    stamps_ns[num_ops] = clock_ns()
    if cuda:
        torch.cuda.synchronize(device)
    elapsed_ns = clock_ns() - stamps_ns[0]
    if samples is not None:
        samples.gbps.append(num_bytes / elapsed_ns)
        samples.num_failed_ops += failed
        samples.op_ms.extend((stamps_ns[i + 1] - stamps_ns[i]) / 1e6 for i in range(num_ops))


def _alternate(num_repeats: int, timed: list[_Timed], case: _Case, device: torch.device) -> None:
    """An untimed warm-up round, then ``num_repeats`` rounds each timing every op in turn."""
    for repeat in range(num_repeats + 1):
        for item in timed:
            if item.prepare is not None:
                item.prepare()
            _time_ops(item.op, len(case.records), case.total_bytes, device, item.samples if repeat else None)


def _row(
    case: _Case,
    tier: TierName,
    op: str,
    samples: _Samples,
    baseline: tuple[str, _Samples],
    target_ratio: float,
    *,
    device: torch.device = _CPU,
    note: str,
    verified: bool | None = None,
    compression_ratio: float | None = None,
) -> TierBenchRow:
    gbps, baseline_gbps = statistics.median(samples.gbps), statistics.median(baseline[1].gbps)
    if samples.num_failed_ops:
        verified = False
        logger.error("%s %s %s: %d ops missed or were rejected", tier, case.name, op, samples.num_failed_ops)
    if verified is False:
        logger.error("%s %s %s: the data read back differs from what was written", tier, case.name, op)
    latency_ms: list[float | None] = [None] * 4
    if samples.op_ms:
        latency_ms = [*np.percentile(samples.op_ms, [50, 90, 99]).tolist(), max(samples.op_ms)]
    ratio = gbps / baseline_gbps
    cpu_cores, user_s, sys_s = _cpu_medians(samples)
    baseline_cpu_cores, baseline_user_s, baseline_sys_s = _cpu_medians(baseline[1])
    return TierBenchRow(
        tier=tier,
        layout=case.name,
        op=op,
        GBps=gbps,
        baseline=baseline[0],
        baseline_GBps=baseline_gbps,
        ratio=ratio,
        target_ratio=target_ratio,
        met=ratio >= target_ratio and verified is not False,
        num_chunks=len(case.records),
        chunk_bytes=case.chunk_bytes,
        num_repeats=len(samples.gbps),
        device=str(device),
        compression_ratio=compression_ratio,
        cpu_cores=cpu_cores,
        baseline_cpu_cores=baseline_cpu_cores,
        user_core_s_per_GB=user_s,
        sys_core_s_per_GB=sys_s,
        baseline_user_core_s_per_GB=baseline_user_s,
        baseline_sys_core_s_per_GB=baseline_sys_s,
        verified=verified,
        p50_ms=latency_ms[0],
        p90_ms=latency_ms[1],
        p99_ms=latency_ms[2],
        max_ms=latency_ms[3],
        note=note,
    )


def _cpu_medians(samples: _Samples) -> tuple[float | None, float | None, float | None]:
    """Median cores busy, user and system core-seconds per GB; ``None`` where the op was not metered."""

    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    return median(samples.cpu_cores), median(samples.user_s_per_gb), median(samples.sys_s_per_gb)


def _bits_equal(left: torch.Tensor, right: torch.Tensor) -> bool:
    return bool(torch.equal(left.view(torch.int16).cpu(), right.view(torch.int16).cpu()))


def _bench_arena(
    options: TierBenchOptions, case: _Case, tier: ArenaTier, device: torch.device, baseline: str, note: str
) -> Iterator[TierBenchRow]:
    """put/get of a cpu or gpu arena against ``copy_`` between preallocated tensors on ``device``."""
    records = case.records
    sources = [source.to(device) for source in case.sources]
    dest = torch.empty((len(records), *sources[0].shape), dtype=sources[0].dtype, device=device)
    outs = [torch.empty_like(source) for source in sources]
    count = len(sources)

    def baseline_put(i: int) -> bool:
        dest[i].copy_(sources[i % count])
        return True

    def baseline_get(i: int) -> bool:
        outs[i % count].copy_(dest[i])
        return True

    def zero_outs() -> None:
        for out in outs:
            out.zero_()

    put, put_base, get, get_base = _Samples(), _Samples(), _Samples(), _Samples()
    tier_put: Op = lambda i: tier.put(records[i], sources[i % count])  # noqa: E731
    tier_get: Op = lambda i: tier.get_into(records[i].key, outs[i % count])  # noqa: E731
    empty_tier = lambda: tier.evict_bytes(tier.capacity_bytes)  # noqa: E731
    _alternate(options.num_repeats, [_Timed(baseline_put, put_base), _Timed(tier_put, put, empty_tier)], case, device)
    _alternate(options.num_repeats, [_Timed(baseline_get, get_base), _Timed(tier_get, get, zero_outs)], case, device)
    verified = all(map(_bits_equal, outs, sources))  # the tier's gets ran last, into zeroed buffers
    target = _TARGET_MEMORY_RATIO
    yield _row(case, tier.name, "put", put, (baseline, put_base), target, device=device, note=note)
    yield _row(case, tier.name, "get", get, (baseline, get_base), target, device=device, note=note, verified=verified)


def _bench_cpu(options: TierBenchOptions, case: _Case) -> Iterator[TierBenchRow]:
    tier = CpuTier(case.layout, options.chunk_size, case.total_bytes)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = list(_bench_arena(options, case, tier, _CPU, "host copy_", "torch threads=1 (tier, baseline)"))
    finally:
        torch.set_num_threads(previous_threads)
        tier.close()
    yield from rows


def _bench_gpu(options: TierBenchOptions, case: _Case, device: torch.device) -> Iterator[TierBenchRow]:
    """gpu put/get, then cpu -> gpu promotion from a cpu tier (pinned under CUDA)."""
    cuda = device.type == "cuda"
    smoke = "" if cuda else " (no CUDA: gpu tier logic on host memory)"
    gpu = GpuTier(case.layout, options.chunk_size, case.total_bytes, device=device)
    cpu = CpuTier(case.layout, options.chunk_size, case.total_bytes, pin_memory=cuda)
    try:
        yield from _bench_arena(options, case, gpu, device, f"d2d copy_{smoke}", "bytes counted once, not r+w")
        records, first = case.records, case.sources[0]
        host = torch.empty((len(records), *first.shape), dtype=first.dtype, pin_memory=cuda)
        for i, record in enumerate(records):
            cpu.put(record, case.source(i))
            host[i].copy_(case.source(i))
        dest = torch.empty_like(host, device=device)

        def baseline(i: int) -> bool:
            dest[i].copy_(host[i])
            return True

        def promote(i: int) -> bool:
            key = records[i].key
            if not cpu.pin(key):
                return False
            try:
                return gpu.put(records[i], cpu.view(key))
            finally:
                cpu.unpin(key)

        measured, base = _Samples(), _Samples()
        empty_gpu = lambda: gpu.evict_bytes(gpu.capacity_bytes)  # noqa: E731
        _alternate(options.num_repeats, [_Timed(baseline, base), _Timed(promote, measured, empty_gpu)], case, device)
        out = torch.zeros_like(dest[0])
        verified = gpu.get_into(records[-1].key, out) and _bits_equal(out, case.source(len(records) - 1))
    finally:
        cpu.close()
        gpu.close()
    label = ("pinned host->device copy_" if cuda else "host copy_") + smoke
    yield _row(
        case,
        TierName.GPU,
        "promote_from_cpu",
        measured,
        (label, base),
        _TARGET_PROMOTE_RATIO,
        device=device,
        note="cpu tier pinned" if cuda else "cpu tier not pinned",
        verified=verified,
    )
