"""``kvstore bench server``: what the server costs over loopback, against the in-process ``TieredStore``.

Two phases, each with its own ``kvstore serve`` child process (tiers: cpu only, so the figures are the
transport's, not the disk's) and an in-process ``TieredStore`` of the same settings, measured in the same run,
alternating repeat by repeat:

- **lookup**: a prompt of ``lookup_tokens`` (15,360: 60 chunks, all cached) planned by ``Client.lookup`` (tokens
  as a numpy array; the plan comes back with every segment), against ``TieredStore.lookup``. Each plan is released
  untimed. Reported: p50/p90/p99/max ms; target p50 <= 1 ms. A ``health`` round trip gives the transport floor.
- **bandwidth**: ``bulk_tokens`` of Llama-3.1-8B-shaped KV (2,048 tokens: 8 chunks of 32 MiB) stored (new keys
  each repeat) and retrieved into a preallocated tensor, through shared memory, against the same calls in
  process. Two client variants: a plain tensor (the client copies it into its scratch segment: one extra copy)
  and a ``Client.buffer`` tensor (no client-side copy). GB/s are 1e9 KV bytes per second; target >= 0.5x.

Every retrieve is checked bit for bit (untimed). The benchmark process (client and in-process store) runs torch on one
thread, as ``kvstore bench tiers`` does: the server copies on its worker threads, which measured like one torch thread,
while two intra-op threads copied the per-chunk token slices much slower on the 2-core development machine (measured:
docs/design-notes.md#bench-server) -- a baseline handicapped that way would flatter the server.
Logs; never prints.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvstore.bench.serve_process import ServeProcess, start_serve_process
from kvstore.bench.server_options import ServerBenchOptions
from kvstore.chunking import Chunking
from kvstore.client import Client
from kvstore.config import GIB, StoreConfig
from kvstore.keys import as_token_array, chunk_bounds
from kvstore.layout import KVLayout
from kvstore.presets import preset_layout
from kvstore.server.kv_events.consumer import free_port
from kvstore.store import TieredStore
from kvstore.surface import StoreSurface
from kvstore.tiers.base import TierName

__all__ = ["ServerBenchOptions", "ServerBenchRow", "run_server_benchmark"]

logger = logging.getLogger(__name__)

_TARGET_LOOKUP_P50_MS = 1.0
_TARGET_BANDWIDTH_RATIO = 0.5


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerBenchRow:
    """One figure: the server's against the in-process store's, their ratio and its target.

    ``unit`` is ``ms`` (lookup latency: ``value`` is the p50, ``ratio`` = in-process p50 / server p50) or
    ``GB/s`` (``ratio`` = server / in-process). ``met``: p50 at most ``target`` (lookup) or ratio at least
    ``target`` (bandwidth), and every read verified. ``kv_events_cpu_share``: with ``--kv-events``, the publisher
    thread's CPU time over the server's during the row's phase (``kvstore_kv_events_cpu_seconds_total``): what
    publishing cost, resolved below the noise of comparing a run with events against one without.
    """

    op: str
    variant: str
    layout: str
    num_tokens: int
    unit: str
    value: float
    baseline: str
    baseline_value: float
    ratio: float
    target: float
    met: bool
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    num_samples: int
    note: str = ""
    kv_events_cpu_share: float | None = None

    def to_json_dict(self) -> dict[str, str | int | float | bool | None]:
        values: dict[str, str | int | float | bool | None] = dataclasses.asdict(self)
        return values


def _start_server(options: ServerBenchOptions, layout: KVLayout, cpu_bytes: int, directory: Path) -> ServeProcess:
    flags = ["--tiers", "cpu", "--cpu-size", str(cpu_bytes), "--chunking", options.chunking.value]
    if options.kv_events:
        flags += ["--kv-events", f"tcp://*:{free_port()}"]
    return start_serve_process(layout, options.chunk_size, directory, flags)


class _ServerCpu:
    """From its making on: the server's CPU time, and its publisher thread's share of it (``None`` without events,
    or where the server's threads' CPU time cannot be read: ``ServeProcess.cpu_s`` reads Linux's ``/proc``)."""

    def __init__(self, server: ServeProcess, kv_events: bool) -> None:
        self._server = server
        self._kv_events = kv_events
        self._server_start_s = server.cpu_s()
        self._publisher_start_s = server.kv_events_cpu_s() if kv_events else 0.0

    def publisher_share(self) -> float | None:
        server_s = self._server.cpu_s() - self._server_start_s
        if not self._kv_events or server_s <= 0:
            return None
        return (self._server.kv_events_cpu_s() - self._publisher_start_s) / server_s


def _chunks_note(options: ServerBenchOptions, num_tokens: int, chunk_mib: float) -> str:
    if options.chunking is Chunking.FIXED:
        return f"{num_tokens // options.chunk_size} chunks of {chunk_mib:.0f} MiB"
    return f"content-defined chunks of at most {chunk_mib:.0f} MiB"


def _share_note(share: float | None) -> str:
    return "" if share is None else f"; the kv event publisher spent {share:.2%} of the server's CPU"


def _percentiles(samples_ms: list[float]) -> tuple[float, float, float, float]:
    p50, p90, p99 = np.percentile(samples_ms, [50, 90, 99]).tolist()
    return float(p50), float(p90), float(p99), max(samples_ms)


def _kv(layout: KVLayout, num_tokens: int, seed: int) -> torch.Tensor:
    """KV of ``num_tokens``: one random chunk's worth of values tiled (cheap to make, every byte written)."""
    generator = torch.Generator().manual_seed(seed)
    tile = torch.randn(layout.chunk_shape(min(num_tokens, 256)), generator=generator).to(layout.dtype.torch_dtype)
    repeats = -(-num_tokens // tile.shape[2])
    return tile.repeat(1, 1, repeats, 1, 1)[:, :, :num_tokens].contiguous()


def run_server_benchmark(
    options: ServerBenchOptions, directory: Path, progress: Callable[[str], None] | None = None
) -> Iterator[ServerBenchRow]:
    """Run both phases, yielding rows as they are measured.

    Args:
        options: what to measure.
        directory: scratch space for the servers' layout files.
        progress: called with a one-line description of each step.
    """
    say = progress or (lambda _message: None)
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server's worker threads copy; 2 threads copy chunk slices slower here
    try:
        say("lookup phase: starting a server")
        yield from _lookup_phase(options, directory, say)
        say("bandwidth phase: starting a server")
        yield from _bandwidth_phase(options, directory, say)
    finally:
        torch.set_num_threads(num_threads)


def _lookup_phase(options: ServerBenchOptions, directory: Path, say: Callable[[str], None]) -> Iterator[ServerBenchRow]:
    layout = preset_layout(options.lookup_layout)
    num_tokens = options.lookup_tokens
    tokens = np.random.default_rng(options.seed).integers(0, 50_000, size=num_tokens)
    # a slot per chunk, whatever its length: content-defined chunks are shorter, so the prompt takes more slots
    num_chunks = len(chunk_bounds(as_token_array(tokens), options.chunk_size, (), options.chunking)) - 1
    cpu_bytes = layout.chunk_bytes(options.chunk_size) * (num_chunks + 1) + GIB // 8
    config = StoreConfig(
        tiers=(TierName.CPU,), chunk_size=options.chunk_size, chunking=options.chunking, cpu_capacity_bytes=cpu_bytes
    )
    kv = _kv(layout, num_tokens, options.seed)
    server = _start_server(options, layout, cpu_bytes, directory)
    try:
        client = Client(server.url, layout, name="kvstore bench server")
        with TieredStore(layout, config) as store, client:
            store.store(tokens, kv)
            client.store(tokens, kv)
            del kv
            server_ms: list[float] = []
            local_ms: list[float] = []
            health_ms: list[float] = []
            say(f"lookup phase: {options.num_lookups} lookups of {num_tokens} tokens each side")
            server_cpu = _ServerCpu(server, options.kv_events)
            for repeat in range(options.num_lookups + 10):
                started = time.perf_counter()
                plan = client.lookup(tokens)
                elapsed_ms = (time.perf_counter() - started) * 1e3
                client.release(plan)
                started = time.perf_counter()
                local_plan = store.lookup(tokens)
                local_elapsed_ms = (time.perf_counter() - started) * 1e3
                store.release(local_plan)
                started = time.perf_counter()
                client.health()
                health_elapsed_ms = (time.perf_counter() - started) * 1e3
                if repeat >= 10:  # warm-up
                    server_ms.append(elapsed_ms)
                    local_ms.append(local_elapsed_ms)
                    health_ms.append(health_elapsed_ms)
            verified = plan.num_prefix_tokens == num_tokens and local_plan.segments == plan.segments
            share = server_cpu.publisher_share()
    finally:
        server.stop()
    p50, p90, p99, worst = _percentiles(server_ms)
    local_p50 = _percentiles(local_ms)[0]
    health_p50 = _percentiles(health_ms)[0]
    yield ServerBenchRow(
        op="lookup", variant="loopback tcp, numpy token ids", layout=options.lookup_layout, num_tokens=num_tokens,
        unit="ms", value=p50, baseline="in-process TieredStore.lookup", baseline_value=local_p50,
        ratio=local_p50 / p50, target=_TARGET_LOOKUP_P50_MS, met=p50 <= _TARGET_LOOKUP_P50_MS and verified,
        p50_ms=p50, p90_ms=p90, p99_ms=p99, max_ms=worst, num_samples=len(server_ms),
        note=f"{len(plan.segments)} segments ({options.chunking.value} chunks); health round trip p50 "
        f"{health_p50:.3f} ms (transport floor)"
        + _share_note(share) + ("" if verified else "; PLANS DIFFER"), kv_events_cpu_share=share,
    )  # fmt: skip


@dataclass(slots=True)
class _Side:
    """Timings of one (op, variant) on one side."""

    seconds: list[float] = dataclasses.field(default_factory=list)
    verified: bool = True


def _bandwidth_phase(
    options: ServerBenchOptions, directory: Path, say: Callable[[str], None]
) -> Iterator[ServerBenchRow]:
    layout = preset_layout(options.bulk_layout)
    num_tokens = options.bulk_tokens
    num_bytes = layout.chunk_bytes(num_tokens)
    cpu_bytes = 3 * layout.chunk_bytes(num_tokens + options.chunk_size)
    config = StoreConfig(
        tiers=(TierName.CPU,), chunk_size=options.chunk_size, chunking=options.chunking, cpu_capacity_bytes=cpu_bytes
    )
    kv = _kv(layout, num_tokens, options.seed)
    rng = np.random.default_rng(options.seed + 1)
    server = _start_server(options, layout, cpu_bytes, directory)
    sides = {(op, variant, where): _Side() for op in ("store", "retrieve") for variant in ("tensor", "buffer")
             for where in ("server", "local")}  # fmt: skip
    try:
        client = Client(server.url, layout, name="kvstore bench server")
        with TieredStore(layout, config) as store, client:
            source_buffer, target_buffer = client.buffer(num_tokens), client.buffer(num_tokens)
            source_buffer.copy_(kv)
            out = torch.empty_like(kv)
            server_cpu = _ServerCpu(server, options.kv_events)
            for repeat in range(options.num_repeats + 1):
                say(f"bandwidth phase: repeat {repeat} of {options.num_repeats} ({num_bytes / 2**20:.0f} MiB)")
                for variant in ("tensor", "buffer"):
                    tokens = rng.integers(0, 50_000, size=num_tokens)
                    source, target = (kv, out) if variant == "tensor" else (source_buffer, target_buffer)
                    for where, owner in (("server", client), ("local", store)):
                        timings = sides[("store", variant, where)], sides[("retrieve", variant, where)]
                        _store_and_retrieve(owner, tokens, source, target, kv, timings, timed=repeat > 0)
            share = server_cpu.publisher_share()
    finally:
        server.stop()
    chunk_mib = layout.chunk_bytes(options.chunk_size) / 2**20
    for op in ("store", "retrieve"):
        for variant in ("tensor", "buffer"):
            remote, local = sides[(op, variant, "server")], sides[(op, variant, "local")]
            gbps = num_bytes / statistics.median(remote.seconds) / 1e9
            base_gbps = num_bytes / statistics.median(local.seconds) / 1e9
            p50, p90, p99, worst = _percentiles([s * 1e3 for s in remote.seconds])
            verified = remote.verified and local.verified
            described = "plain tensor (copied through the scratch segment)" if variant == "tensor" else (
                "Client.buffer (no client-side copy)")  # fmt: skip
            yield ServerBenchRow(
                op=op, variant=f"shared memory, {described}", layout=options.bulk_layout, num_tokens=num_tokens,
                unit="GB/s", value=gbps, baseline=f"in-process TieredStore.{op}", baseline_value=base_gbps,
                ratio=gbps / base_gbps, target=_TARGET_BANDWIDTH_RATIO,
                met=gbps / base_gbps >= _TARGET_BANDWIDTH_RATIO and verified, p50_ms=p50, p90_ms=p90, p99_ms=p99,
                max_ms=worst, num_samples=len(remote.seconds),
                note=_chunks_note(options, num_tokens, chunk_mib) + _share_note(share)
                + ("" if verified else "; READ BACK DIFFERENT BYTES"), kv_events_cpu_share=share,
            )  # fmt: skip


def _store_and_retrieve(
    owner: StoreSurface,
    tokens: np.ndarray,
    source: torch.Tensor,
    target: torch.Tensor,
    expected: torch.Tensor,
    timings: tuple[_Side, _Side],
    *,
    timed: bool,
) -> None:
    """One timed store of new keys and one timed retrieve of them (lookups, checks and the eviction untimed)."""
    store_side, retrieve_side = timings
    target.zero_()
    started = time.perf_counter()
    owner.store(tokens, source)
    store_s = time.perf_counter() - started
    plan = owner.lookup(tokens)
    started = time.perf_counter()
    result = owner.retrieve(plan, target)
    retrieve_s = time.perf_counter() - started
    ok = result.num_prefix_tokens == len(tokens) and torch.equal(target, expected)
    plan = owner.lookup(tokens)  # drop the keys again: every repeat stores new chunks into the same room
    owner.release(plan)
    owner.evict([segment.key for segment in plan.segments])
    if timed:
        store_side.seconds.append(store_s)
        retrieve_side.seconds.append(retrieve_s)
        store_side.verified &= ok
        retrieve_side.verified &= ok
    if not ok:
        logger.error("server benchmark: a retrieve read back different bytes")
