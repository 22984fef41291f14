"""Prometheus metrics of a server, and the HTTP endpoint that serves them (``/metrics``) with ``/healthz``.

Three kinds of figures:

- counted by the server per request (its own ``CollectorRegistry``, no process-global state): requests by op and
  outcome, lookup / retrieve / store latency histograms, bulk bytes by direction and transport, lookup tokens by
  how the plan covers them (exact, blend, gap) and the per-prompt coverage ratios;
- the same requests counted per engine (``kvstore_engine_*``, label ``engine``: the ``client_name`` the client
  sent in its hello, e.g. ``vllm-engine-0 worker``): lookups, lookup tokens, hit tokens (the plan's exact prefix),
  tokens and KV bytes by direction (stored: the new chunks'; retrieved: the loaded segments'), and lookup / store /
  retrieve latency histograms. The label is bounded: the first ``MAX_ENGINES`` distinct names keep theirs for the
  server's life, every later name counts under ``engine="other"`` (logged at WARNING once), so a fleet of
  restarting engines with fresh names cannot grow the exposition without bound;
- read from ``TieredStore.stats()`` at scrape time (``_StoreCollector``), so they never drift from the store:
  per tier hits, misses, puts, rejected puts, evictions, corrupt reads (counters), capacity, used and stored
  bytes, chunks and pinned chunks (gauges); the content index's entries, aliases and strikes; with a remote tier
  its availability, outages, failed and skipped calls, queued bytes and fleet directory records
  (``kvstore_remote_*``); open plans, sessions and connected clients;
- with ``--kv-events``, the event publisher's batches, events by type, queued changes and replay requests
  (``kvstore_kv_events_*``), read from the publisher at scrape time.

Threads: the HTTP server runs ``ThreadingHTTPServer`` threads (named ``kvstore-metrics``); prometheus-client's
metrics are thread-safe; the collector calls ``stats()``, which is. Request workers resolve engines concurrently:
``_engines_lock`` guards the engine tables (by name and by client id).
"""

from __future__ import annotations

import http.server
import json
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from kvstore.errors import ConfigError
from kvstore.misses import STORE_REASONS
from kvstore.server.chunk_assembly import AssemblyCounts
from kvstore.server.kv_events.options import KVEventStats
from kvstore.server.usage.plan_coverage import PlanCoverage
from kvstore.stats import RemoteStats, StoreStats
from kvstore.tiers.base import TierName
from kvstore.wire.values import ServerHealth

__all__ = ["MAX_ENGINES", "OTHER_ENGINE", "BulkTransfer", "EngineMetrics", "MetricsServer", "ServerMetrics"]

logger = logging.getLogger(__name__)

MAX_ENGINES = 64
"""Distinct client names with an ``engine`` label of their own; later names count under ``OTHER_ENGINE``."""

OTHER_ENGINE = "other"

_LOOKUP_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_BULK_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99, 1.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class _StatsSources:
    store_stats: Callable[[], StoreStats | None]
    num_clients: Callable[[], int]


class _StoreCollector(Collector):
    """Store and tier counters, read from ``stats()`` at each scrape."""

    def __init__(self, sources: _StatsSources) -> None:
        self._sources = sources

    def collect(self) -> Iterator[Metric]:
        clients = GaugeMetricFamily("kvstore_clients", "Clients registered with the server.")
        clients.add_metric([], self._sources.num_clients())
        yield clients
        stats = self._sources.store_stats()
        if stats is None:
            return
        counters = {
            "hits": "Chunks lookups planned from this tier (the fastest holding them); equals kvstore_lookup_chunks.",
            "misses": "Chunks lookups looked for that this tier did not serve (another tier or none did).",
            "puts": "Chunks written into this tier.",
            "rejected_puts": "Chunks this tier refused because everything resident was pinned.",
            "evictions": "Chunks this tier dropped or demoted to make room.",
            "corrupt_reads": "Chunks that failed their checksum (a counted miss).",
        }
        for name, help_text in counters.items():
            family = CounterMetricFamily(f"kvstore_tier_{name}", help_text, labels=["tier"])
            for tier in stats.tiers:
                family.add_metric([tier.tier.value], getattr(tier, name))
            yield family
        gauges = {
            "capacity_bytes": "Capacity of this tier (disk: stored bytes cap).",
            "used_bytes": "Uncompressed KV bytes resident in this tier.",
            "stored_bytes": "Bytes the resident chunks occupy (compressed on disk).",
            "num_chunks": "Chunks resident in this tier.",
            "num_pinned": "Chunks pinned in this tier (open plans, pending writes).",
        }
        for name, help_text in gauges.items():
            gauge = GaugeMetricFamily(f"kvstore_tier_{name.removeprefix('num_')}", help_text, labels=["tier"])
            for tier in stats.tiers:
                gauge.add_metric([tier.tier.value], getattr(tier, name))
            yield gauge
        plans = GaugeMetricFamily("kvstore_open_plans", "Plans looked up and not yet retrieved or released.")
        plans.add_metric([], stats.num_open_plans)
        yield plans
        sessions = GaugeMetricFamily("kvstore_sessions", "Sessions holding open plans.")
        sessions.add_metric([], stats.num_sessions)
        yield sessions
        missed = CounterMetricFamily(
            "kvstore_missed_tokens",
            "Tokens not served, by reason (kvstore.misses): lookups' gaps (they add up to kvstore_lookup_tokens"
            "{kind=\"gap\"}) and retrieves' planned tokens that could not be served.",
            labels=["reason"],
        )
        counted = stats.lookups.missed_tokens
        for reason in dict.fromkeys([*(reason.value for reason in STORE_REASONS), *counted]):  # 0 until one occurs
            missed.add_metric([reason], counted.get(reason, 0))
        yield missed
        if stats.catalog is not None:
            catalog = stats.catalog
            strikes = CounterMetricFamily("kvstore_blend_strikes", "Index entries found pointing at a gone chunk.")
            strikes.add_metric([], catalog.num_strikes)
            yield strikes
            struck_out = CounterMetricFamily("kvstore_blend_struck_out", "Index entries removed at their 2nd strike.")
            struck_out.add_metric([], catalog.num_struck_out)
            yield struck_out
            entries = GaugeMetricFamily("kvstore_blend_index_entries", "Chunks in the content fingerprint index.")
            entries.add_metric([], catalog.num_entries)
            yield entries
            aliases = GaugeMetricFamily("kvstore_blend_aliases", "Dedup-content aliases.")
            aliases.add_metric([], catalog.num_aliases)
            yield aliases
        if stats.remote is not None:
            yield from _remote_metrics(stats.remote)


def _remote_metrics(remote: RemoteStats) -> Iterator[Metric]:
    """The remote tier's link and fleet directory (its chunk counters are the ``tier="remote"`` series)."""
    available = GaugeMetricFamily("kvstore_remote_available", "1 while the remote answers, 0 during an outage.")
    available.add_metric([], int(remote.available))
    yield available
    counters = {
        "outages": "Outages of the remote (each logged once, with its recovery).",
        "resets": "Times the remote was found emptied (restarted without persistence, flushed) and forgotten.",
        "failed_calls": "Remote calls that failed (network, timeout, refused), skipped ones included.",
        "skipped_calls": "Remote calls answered locally during an outage, without a round trip.",
        "directory_records": "Fleet directory records read from other hosts.",
        "directory_bad_records": "Fleet directory records that failed their checks (skipped).",
    }
    for name, help_text in counters.items():
        family = CounterMetricFamily(f"kvstore_remote_{name}", help_text)
        family.add_metric([], getattr(remote, name))
        yield family
    queued = GaugeMetricFamily("kvstore_remote_queued_bytes", "Chunk bytes waiting to be written to the remote.")
    queued.add_metric([], remote.queued_bytes)
    yield queued


class _KVEventCollector(Collector):
    """The KV event publisher's counts (``kvstore serve --kv-events``), read at each scrape."""

    def __init__(self, stats: Callable[[], KVEventStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        batches = CounterMetricFamily("kvstore_kv_events_batches", "KV event batches published (seq of the next one).")
        batches.add_metric([], stats.batches)
        yield batches
        events = CounterMetricFamily("kvstore_kv_events", "KV events published, by vLLM event type.", labels=["type"])
        for kind, count in stats.events.items():
            events.add_metric([kind], count)
        yield events
        queued = GaugeMetricFamily("kvstore_kv_events_queued", "Residency changes heard and not yet published.")
        queued.add_metric([], stats.queued)
        yield queued
        requests = CounterMetricFamily(
            "kvstore_kv_events_requests", "Replay socket requests answered, by kind (replay, snapshot, invalid).",
            labels=["kind"],
        )  # fmt: skip
        for kind, count in stats.requests.items():
            requests.add_metric([kind], count)
        yield requests
        cpu = CounterMetricFamily(
            "kvstore_kv_events_cpu_seconds", "CPU time of the publisher's thread (encoding, sending, answering)."
        )
        cpu.add_metric([], stats.cpu_s)
        yield cpu


class _ChunkPartsCollector(Collector):
    """Chunks stored by parts (tensor- or pipeline-parallel engines' ranks), read at each scrape."""

    def __init__(self, counts: Callable[[], AssemblyCounts]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        counts = self._counts()
        parts = CounterMetricFamily(
            "kvstore_chunk_parts",
            "Chunk parts stored by the ranks of parallel engines, by outcome: received (a part of one chunk), "
            "completed (a chunk whose last part arrived, committed whole), expired and dropped (incomplete chunks "
            "given up after the TTL or for room; never stored).",
            labels=["outcome"],
        )
        for outcome in ("received", "completed", "expired", "dropped"):
            parts.add_metric([outcome], getattr(counts, "parts" if outcome == "received" else outcome))
        yield parts
        pending = GaugeMetricFamily("kvstore_chunk_parts_pending", "Chunks waiting for more of their parts.")
        pending.add_metric([], counts.pending)
        yield pending
        pending_bytes = GaugeMetricFamily("kvstore_chunk_parts_pending_bytes", "Staging bytes of those chunks.")
        pending_bytes.add_metric([], counts.pending_bytes)
        yield pending_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class BulkTransfer:
    """One store or retrieve, as the metrics count it.

    Args:
        transport: how the KV travelled: ``shm``, ``inline`` or ``cuda_ipc``.
        seconds: server time of the request.
        num_bulk_bytes: KV bytes that crossed the transport (a store's tail, a retrieve's buffer up to the plan's
            end, gaps included).
        num_tokens: a store's new chunks' tokens (chunks already held, aliased or rejected are not stored); a
            retrieve's loaded segments' tokens.
        num_bytes: the KV bytes of those tokens.
    """

    transport: str
    seconds: float
    num_bulk_bytes: int
    num_tokens: int
    num_bytes: int


class EngineMetrics:
    """The per-engine series of one ``engine`` label value, resolved once (``labels()`` locks and hashes on every call).

    Made by ``ServerMetrics.add_client``; the request workers update it through ``ServerMetrics.observe_*``.
    """

    def __init__(self, metrics: ServerMetrics, engine: str) -> None:
        self.engine = engine
        self._lookups = metrics.engine_lookups.labels(engine)
        self._lookup_tokens = metrics.engine_lookup_tokens.labels(engine)
        self._hit_tokens = metrics.engine_hit_tokens.labels(engine)
        self._stored_tokens = metrics.engine_tokens.labels(engine, "stored")
        self._stored_bytes = metrics.engine_bytes.labels(engine, "stored")
        self._retrieved_tokens = metrics.engine_tokens.labels(engine, "retrieved")
        self._retrieved_bytes = metrics.engine_bytes.labels(engine, "retrieved")
        self._lookup_seconds = metrics.engine_lookup_seconds.labels(engine)
        self._store_seconds = metrics.engine_store_seconds.labels(engine)
        self._retrieve_seconds = metrics.engine_retrieve_seconds.labels(engine)

    def observe_lookup(self, coverage: PlanCoverage | None, seconds: float) -> None:
        """A lookup; its tokens only with ``coverage`` (a repeated lookup of a request's prompt has none)."""
        self._lookups.inc()
        if coverage is not None:
            self._lookup_tokens.inc(coverage.num_query_tokens)
            self._hit_tokens.inc(coverage.num_prefix_tokens)
        self._lookup_seconds.observe(seconds)

    def observe_store(self, transfer: BulkTransfer) -> None:
        self._stored_tokens.inc(transfer.num_tokens)
        self._stored_bytes.inc(transfer.num_bytes)
        self._store_seconds.observe(transfer.seconds)

    def observe_retrieve(self, transfer: BulkTransfer) -> None:
        self._retrieved_tokens.inc(transfer.num_tokens)
        self._retrieved_bytes.inc(transfer.num_bytes)
        self._retrieve_seconds.observe(transfer.seconds)


class ServerMetrics:
    """The server's metrics, in a registry of their own.

    Args:
        store_stats: the store's stats, or ``None`` while no layout is registered.
        num_clients: clients registered now.
    """

    def __init__(self, store_stats: Callable[[], StoreStats | None], num_clients: Callable[[], int]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        registry = self.registry
        self.requests = Counter(
            "kvstore_requests", "Requests answered, by op and outcome (ok or the error code).", ["op", "outcome"],
            registry=registry,
        )  # fmt: skip
        self.lookup_seconds = Histogram(
            "kvstore_lookup_seconds", "Server time of a lookup.", buckets=_LOOKUP_BUCKETS_S, registry=registry
        )
        self.retrieve_seconds = Histogram(
            "kvstore_retrieve_seconds", "Server time of a retrieve, by transport.", ["transport"],
            buckets=_BULK_BUCKETS_S, registry=registry,
        )  # fmt: skip
        self.store_seconds = Histogram(
            "kvstore_store_seconds", "Server time of a store, by transport.", ["transport"],
            buckets=_BULK_BUCKETS_S, registry=registry,
        )  # fmt: skip
        self.bulk_bytes = Counter(
            "kvstore_bulk_bytes", "KV bytes moved, by direction (stored, retrieved) and transport.",
            ["direction", "transport"], registry=registry,
        )  # fmt: skip
        self.lookup_tokens = Counter(
            "kvstore_lookup_tokens", "Prompt tokens looked up, by coverage: exact, blend or gap (to compute).",
            ["kind"], registry=registry,
        )  # fmt: skip
        self.lookup_chunks = Counter(
            "kvstore_lookup_chunks", "Chunks lookups planned, by the tier that held each (none: a miss).",
            ["tier"], registry=registry,
        )  # fmt: skip
        self.coverage_ratio = Histogram(
            "kvstore_lookup_coverage_ratio", "Per lookup: cached tokens / prompt tokens.",
            buckets=_RATIO_BUCKETS, registry=registry,
        )  # fmt: skip
        self.blend_coverage_ratio = Histogram(
            "kvstore_blend_coverage_ratio", "Per lookup: tokens covered by blend segments / prompt tokens.",
            buckets=_RATIO_BUCKETS, registry=registry,
        )  # fmt: skip
        self._add_engine_families()
        registry.register(_StoreCollector(_StatsSources(store_stats=store_stats, num_clients=num_clients)))
        # Labelled children resolved once: ``labels()`` locks and hashes on every call, up to seven of them a lookup.
        self._exact_tokens = self.lookup_tokens.labels("exact")
        self._blend_tokens = self.lookup_tokens.labels("blend")
        self._gap_tokens = self.lookup_tokens.labels("gap")
        self._chunks_by_tier = {tier: self.lookup_chunks.labels(tier.value) for tier in TierName}
        self._missed_chunks = self.lookup_chunks.labels("none")
        self._engines_lock = threading.Lock()
        self._engine_of_name: dict[str, EngineMetrics] = {}  # at most MAX_ENGINES names, never shrinks
        self._engine_of_client: dict[str, EngineMetrics] = {}  # registered clients with a layout
        self._other_engine: EngineMetrics | None = None  # made when first needed
        self._folding_logged = False

    def _add_engine_families(self) -> None:
        registry = self.registry
        self.engine_lookups = Counter(
            "kvstore_engine_lookups", "Lookups answered, by engine (the client's hello name).", ["engine"],
            registry=registry,
        )  # fmt: skip
        self.engine_lookup_tokens = Counter(
            "kvstore_engine_lookup_tokens", "Prompt tokens looked up, by engine.", ["engine"], registry=registry
        )
        self.engine_hit_tokens = Counter(
            "kvstore_engine_hit_tokens",
            "Looked-up tokens covered by the plan's exact prefix (LookupPlan.num_prefix_tokens), by engine.",
            ["engine"], registry=registry,
        )  # fmt: skip
        self.engine_tokens = Counter(
            "kvstore_engine_tokens",
            "KV tokens by engine and direction: stored (new chunks' tokens), retrieved (loaded segments' tokens).",
            ["engine", "direction"], registry=registry,
        )  # fmt: skip
        self.engine_bytes = Counter(
            "kvstore_engine_bytes", "KV bytes of kvstore_engine_tokens, by engine and direction.",
            ["engine", "direction"], registry=registry,
        )  # fmt: skip
        self.engine_lookup_seconds = Histogram(
            "kvstore_engine_lookup_seconds", "Server time of a lookup, by engine.", ["engine"],
            buckets=_LOOKUP_BUCKETS_S, registry=registry,
        )  # fmt: skip
        self.engine_store_seconds = Histogram(
            "kvstore_engine_store_seconds", "Server time of a store, by engine.", ["engine"],
            buckets=_BULK_BUCKETS_S, registry=registry,
        )  # fmt: skip
        self.engine_retrieve_seconds = Histogram(
            "kvstore_engine_retrieve_seconds", "Server time of a retrieve, by engine.", ["engine"],
            buckets=_BULK_BUCKETS_S, registry=registry,
        )  # fmt: skip

    # -- engines -------------------------------------------------------------------------------------------------

    def add_client(self, client_id: str, client_name: str) -> EngineMetrics:
        """Count a newly registered client's requests under its name's ``engine`` label (``OTHER_ENGINE`` once
        ``MAX_ENGINES`` other names have theirs). ``forget_client`` when it departs."""
        with self._engines_lock:
            engine = self._engine_of_name.get(client_name)
            if engine is None:
                engine = self._new_engine_locked(client_name)
            self._engine_of_client[client_id] = engine
            return engine

    def _new_engine_locked(self, client_name: str) -> EngineMetrics:
        if client_name == OTHER_ENGINE:
            return self._other_engine_locked()
        if len(self._engine_of_name) < MAX_ENGINES:
            engine = self._engine_of_name[client_name] = EngineMetrics(self, client_name)
            return engine
        if not self._folding_logged:
            self._folding_logged = True
            logger.warning(
                "%d client names have an engine label already; %r and every later new name count under engine=%r",
                MAX_ENGINES, client_name, OTHER_ENGINE,
            )  # fmt: skip
        return self._other_engine_locked()

    def _other_engine_locked(self) -> EngineMetrics:
        if self._other_engine is None:
            self._other_engine = EngineMetrics(self, OTHER_ENGINE)
        return self._other_engine

    def forget_client(self, client_id: str) -> None:
        """A client departed (goodbye, died, idle): its name's series stay, its id goes."""
        with self._engines_lock:
            self._engine_of_client.pop(client_id, None)

    def engine_of(self, client_id: str) -> EngineMetrics:
        """The engine a registered client counts under (``OTHER_ENGINE`` for one unknown here)."""
        with self._engines_lock:
            engine = self._engine_of_client.get(client_id)
            return engine if engine is not None else self._other_engine_locked()

    # -- per request ---------------------------------------------------------------------------------------------

    def observe_store(self, transfer: BulkTransfer, engine: EngineMetrics) -> None:
        self.store_seconds.labels(transfer.transport).observe(transfer.seconds)
        self.bulk_bytes.labels("stored", transfer.transport).inc(transfer.num_bulk_bytes)
        engine.observe_store(transfer)

    def observe_retrieve(self, transfer: BulkTransfer, engine: EngineMetrics) -> None:
        self.retrieve_seconds.labels(transfer.transport).observe(transfer.seconds)
        self.bulk_bytes.labels("retrieved", transfer.transport).inc(transfer.num_bulk_bytes)
        engine.observe_retrieve(transfer)

    def observe_lookup(self, coverage: PlanCoverage, seconds: float, engine: EngineMetrics) -> None:
        engine.observe_lookup(coverage, seconds)
        self.lookup_seconds.observe(seconds)
        self._exact_tokens.inc(coverage.num_exact_tokens)
        self._blend_tokens.inc(coverage.num_blend_tokens)
        self._gap_tokens.inc(coverage.num_gap_tokens)
        for tier, count in coverage.num_chunks_by_tier.items():
            self._chunks_by_tier[tier].inc(count)  # one labelled update per tier, not per segment
        if coverage.num_missed_chunks:
            self._missed_chunks.inc(coverage.num_missed_chunks)
        if coverage.num_query_tokens:
            cached = coverage.num_exact_tokens + coverage.num_blend_tokens
            self.coverage_ratio.observe(cached / coverage.num_query_tokens)
            self.blend_coverage_ratio.observe(coverage.num_blend_tokens / coverage.num_query_tokens)

    def observe_repeat_lookup(self, seconds: float, engine: EngineMetrics) -> None:
        """A lookup of a prompt its request looked up before: its time and its count, not its tokens again."""
        engine.observe_lookup(None, seconds)
        self.lookup_seconds.observe(seconds)

    def watch_kv_events(self, stats: Callable[[], KVEventStats]) -> None:
        """Export the KV event publisher's counts (``kvstore_kv_events_*``)."""
        self.registry.register(_KVEventCollector(stats))

    def watch_chunk_parts(self, counts: Callable[[], AssemblyCounts]) -> None:
        """Export the counts of chunks assembled from parts (``kvstore_chunk_parts*``)."""
        self.registry.register(_ChunkPartsCollector(counts))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class MetricsServer:
    """``/metrics`` (Prometheus text format) and ``/healthz`` (200 while serving, 503 otherwise) over HTTP.

    Args:
        host: interface to bind.
        port: TCP port (0: any free port; read ``port`` after).
        metrics: what ``/metrics`` exposes.
        health: what ``/healthz`` reports.

    Raises:
        ConfigError: the port cannot be bound.
    """

    def __init__(self, host: str, port: int, metrics: ServerMetrics, health: Callable[[], ServerHealth]) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    try:
                        body = metrics.exposition()
                    except Exception:  # the request boundary: a failing collector is a 500, not a dead thread
                        logger.exception("metrics exposition failed")
                        self._answer(500, "text/plain", b"metrics failed; see the server log\n")
                        return
                    self._answer(200, CONTENT_TYPE_LATEST, body)
                elif path == "/healthz":
                    report = health()
                    body = json.dumps(
                        {"status": report.status, "uptime_s": round(report.uptime_s, 3),
                         "layout_registered": report.layout_registered, "version": report.server_version}
                    ).encode()  # fmt: skip
                    self._answer(200 if report.status == "serving" else 503, "application/json", body)
                else:
                    self._answer(404, "text/plain", b"not found: try /metrics or /healthz\n")

            def _answer(self, code: int, content_type: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                logger.debug("metrics http: " + format, *args)

        try:
            self._server = http.server.ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise ConfigError(
                f"cannot serve metrics on {host}:{port}: {exc.strerror}; pick another --metrics-port"
            ) from exc
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvstore-metrics", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()
