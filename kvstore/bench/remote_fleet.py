"""``kvstore bench remote``, part 3: ``kvstore serve`` hosts sharing one Valkey, and that Valkey killed mid-run.

``num_hosts`` servers (tiers cpu,disk,remote, blending on, data dirs of their own) on loopback share a Valkey the
benchmark started. Through host 1 a client stores two documents of random KV; then

* ``prefix_identical``: host N's client looks document A up (its prompt starts with it) and retrieves it: every
  chunk planned from the remote, the KV bit-identical to what host 1 was given;
* ``moved_identical``: the same for document B inside a new prompt (37 other tokens before it): every chunk found
  by content at its new position, from the remote, bit-identical to its source;
* the outage: one client per host stores a fresh two-chunk document, retrieves it and document A in a loop for
  ``run_s`` seconds; Valkey is killed at a third of the run and restarted at two thirds. ``failed_requests`` counts
  requests that raised or returned wrong KV (target 0); ``max_request_ms`` is the slowest request of the run;
  ``outage_log_lines`` / ``reconnect_log_lines`` count the hosts' "unreachable" / "reachable again" lines (one
  each per host is the design) and ``tracebacks`` any traceback in their logs.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvstore.bench.serve_process import ServeProcess, start_serve_process
from kvstore.bench.valkey_server import ValkeyServer
from kvstore.client import Client
from kvstore.layout import KVLayout
from kvstore.plan import LookupPlan, Segment
from kvstore.tiers.base import TierName

__all__ = ["FleetRow", "lookup_when_known", "run_fleet"]

_MOVED_BY = 37
_KNOWN_DEADLINE_S = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetRow:
    """The fleet part's figures (see the module docstring)."""

    part: str
    hosts: int
    document_tokens: int
    prefix_identical: bool
    moved_identical: bool
    directory_lag_ms: float
    run_s: float
    requests: int
    failed_requests: int
    outage_s: float
    request_ms_p50: float
    max_request_ms: float
    servers_alive: bool
    outage_log_lines: int
    reconnect_log_lines: int
    tracebacks: int
    met: bool


def run_fleet(
    valkey: ValkeyServer,
    layout: KVLayout,
    chunk_size: int,
    directory: Path,
    *,
    num_hosts: int = 4,
    document_chunks: int = 4,
    run_s: float = 9.0,
    seed: int = 0,
) -> FleetRow:
    """Start the hosts, measure, stop them (see the module docstring). ``valkey`` must be this benchmark's own."""
    rng = np.random.default_rng(seed)
    num_tokens = document_chunks * chunk_size + chunk_size // 3
    document_a, document_b = (rng.integers(0, 100_000, num_tokens) for _ in range(2))
    kv_a, kv_b = (_kv(layout, num_tokens, seed + index) for index in range(2))
    with _hosts(valkey, layout, chunk_size, directory, num_hosts) as hosts:
        with Client(hosts[0].url, layout) as first, Client(hosts[-1].url, layout) as last:
            first.store(document_a, kv_a)
            first.store(document_b, kv_b)
            first.flush()
            published = time.perf_counter()
            moved_prompt = np.concatenate([rng.integers(0, 100_000, _MOVED_BY), document_b])
            moved_plan = lookup_when_known(last, moved_prompt, num_tokens)
            lag_ms = (time.perf_counter() - published) * 1e3
            moved_identical = _from_remote(moved_plan) and _moved_equal(last, moved_plan, kv_b, num_tokens)
            prefix_plan = last.lookup(document_a)
            prefix_identical = _from_remote(prefix_plan) and torch.equal(last.retrieve(prefix_plan).kv, kv_a)
        outcome = _outage_run(valkey, hosts, layout, chunk_size, document_a, kv_a, run_s, seed)
        alive = all(host.process.poll() is None for host in hosts)
    logs = [host.stderr_path.read_text() for host in hosts]  # stopped: every line is written
    return FleetRow(
        part="fleet",
        hosts=num_hosts,
        document_tokens=num_tokens,
        prefix_identical=prefix_identical,
        moved_identical=moved_identical,
        directory_lag_ms=round(lag_ms, 1),
        run_s=run_s,
        requests=outcome.requests,
        failed_requests=outcome.failures,
        outage_s=round(outcome.outage_s, 2),
        request_ms_p50=round(float(np.median(outcome.latencies_ms)), 2),
        max_request_ms=round(max(outcome.latencies_ms), 1),
        servers_alive=alive,
        outage_log_lines=sum(log.count("unreachable") for log in logs),
        reconnect_log_lines=sum(log.count("reachable again") for log in logs),
        tracebacks=sum(log.count("Traceback") for log in logs),
        met=prefix_identical and moved_identical and outcome.failures == 0 and alive,
    )


@contextlib.contextmanager
def _hosts(
    valkey: ValkeyServer, layout: KVLayout, chunk_size: int, directory: Path, count: int
) -> Iterator[list[ServeProcess]]:
    started: list[ServeProcess] = []
    try:
        for index in range(count):
            flags = [
                "--tiers", "cpu,disk,remote", "--remote-url", valkey.url, "--enable-blend",
                "--data-dir", str(directory / f"host{index + 1}"), "--cpu-size", "512MiB", "--disk-size", "2GiB",
            ]  # fmt: skip
            started.append(start_serve_process(layout, chunk_size, directory, flags, name=f"host{index + 1}"))
        yield started
    finally:
        for host in started:
            host.stop()


def _kv(layout: KVLayout, num_tokens: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(layout.chunk_shape(num_tokens), generator=generator).to(layout.dtype.torch_dtype)


def lookup_when_known(client: Client, prompt: np.ndarray, num_tokens: int) -> LookupPlan:
    """Look up until the plan covers ``num_tokens``, for up to 10 s: another host's directory reader runs every 50 ms,
    so what one host stored reaches another's plans within about that."""
    deadline = time.monotonic() + _KNOWN_DEADLINE_S
    while True:
        plan = client.lookup(prompt)
        if sum(s.num_tokens for s in plan.segments) >= num_tokens or time.monotonic() > deadline:
            return plan
        client.release(plan)
        time.sleep(0.005)


def _from_remote(plan: LookupPlan) -> bool:
    return bool(plan.segments) and all(segment.tier is TierName.REMOTE for segment in plan.segments)


def _moved_equal(client: Client, plan: LookupPlan, kv: torch.Tensor, num_tokens: int) -> bool:
    result = client.retrieve(plan)
    covered = sum(segment.num_tokens for segment in result.segments)
    return covered == num_tokens and all(
        segment.start == segment.source_start + _MOVED_BY
        and torch.equal(result.kv[:, :, segment.start : segment.end], _source(kv, segment))
        for segment in result.segments
    )


def _source(kv: torch.Tensor, segment: Segment) -> torch.Tensor:
    return kv[:, :, segment.source_start : segment.source_start + segment.num_tokens]


@dataclass(slots=True)
class _Outcome:
    requests: int
    failures: int
    outage_s: float
    latencies_ms: list[float]


def _outage_run(
    valkey: ValkeyServer,
    hosts: list[ServeProcess],
    layout: KVLayout,
    chunk_size: int,
    document: np.ndarray,
    kv: torch.Tensor,
    run_s: float,
    seed: int,
) -> _Outcome:
    lock = threading.Lock()
    outcome = _Outcome(requests=0, failures=0, outage_s=0.0, latencies_ms=[])
    stop = threading.Event()

    def drive(host_index: int) -> None:
        rng = np.random.default_rng(seed + 100 + host_index)
        with Client(hosts[host_index].url, layout) as client:
            while not stop.is_set():
                tokens = rng.integers(0, 100_000, 2 * chunk_size)
                fresh = _kv(layout, len(tokens), int(rng.integers(0, 2**31)))
                requests = (
                    functools.partial(client.store, tokens, fresh),
                    functools.partial(_served, client, tokens, fresh, complete=True),
                    functools.partial(_served, client, document, kv, complete=False),
                )
                for request in requests:
                    started = time.perf_counter()
                    try:
                        ok = request() is not False
                    except Exception:  # a failed request is what this run counts
                        ok = False
                    elapsed_ms = (time.perf_counter() - started) * 1e3
                    with lock:
                        outcome.requests += 1
                        outcome.failures += not ok
                        outcome.latencies_ms.append(elapsed_ms)

    threads = [threading.Thread(target=drive, args=(index,), daemon=True) for index in range(len(hosts))]
    for thread in threads:
        thread.start()
    time.sleep(run_s / 3)
    valkey.kill()
    killed = time.perf_counter()
    time.sleep(run_s / 3)
    valkey.restart()
    outcome.outage_s = time.perf_counter() - killed
    time.sleep(run_s / 3)
    stop.set()
    for thread in threads:
        thread.join()
    return outcome


def _served(client: Client, document: np.ndarray, kv: torch.Tensor, *, complete: bool) -> bool:
    """A lookup and retrieve of a document: what is served must be right, and all of it when ``complete`` (a
    document this host stored). Document A may be partly served: with Valkey down its chunks come from the host's
    own tiers if an earlier retrieve promoted them there, and are misses otherwise."""
    result = client.retrieve(client.lookup(document))
    served = result.kv.shape[2]
    return (served == len(document) or not complete) and torch.equal(result.kv, kv[:, :, :served])
