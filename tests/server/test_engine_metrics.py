"""Per-engine usage in ``/metrics``: each client's hello name is an ``engine`` label on lookups, hit tokens,
stored and retrieved tokens and bytes and latency histograms; the label is bounded (``MAX_ENGINES``, then
``other``) and a departed client's id is forgotten."""

from __future__ import annotations

import logging
import time
import urllib.request
from pathlib import Path

import pytest

from kvstore import Client, StoreConfig
from kvstore.keys import PrefixKey, as_token_array, prefix_keys
from kvstore.plan import LookupPlan, Segment
from kvstore.server.clients import ClientRegistry
from kvstore.server.handlers import RequestHandler, ServerIdentity
from kvstore.server.metrics import MAX_ENGINES, OTHER_ENGINE, ServerMetrics
from kvstore.server.store_host import StoreHost
from kvstore.server.usage.plan_coverage import PlanCoverage
from kvstore.tiers.base import TierName
from kvstore.wire.messages import HelloArgs
from kvstore.wire.protocol import Limits, Op, decode_reply, decode_request, encode_request
from tests.factories import make_kv, make_tokens
from tests.server.conftest import CHUNK_SIZE, SERVER_LAYOUT, ServerProcess

pytestmark = pytest.mark.slow

WORKER = "vllm-engine-7 worker"
SCHEDULER = "vllm-engine-7 scheduler"


def scrape(server: ServerProcess) -> dict[str, float]:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"}


def engine_values(values: dict[str, float], engine: str) -> dict[str, float]:
    """The engine's samples, by metric name (with its other labels, ``engine`` dropped)."""
    marker = f'engine="{engine}"'
    found = {}
    for name, value in values.items():
        if marker in name:
            found[name.replace(marker + ",", "").replace("," + marker, "").replace("{" + marker + "}", "")] = value
    return found


def test_engines_are_counted_apart_by_their_hello_names(server: ServerProcess) -> None:
    bytes_of = SERVER_LAYOUT.chunk_bytes
    prompt = make_tokens(60, seed=91)  # 16 + 16 + 16 + 12: a partial last chunk
    kv = make_kv(SERVER_LAYOUT, 60, seed=91)
    with (
        Client(server.url, SERVER_LAYOUT, name=WORKER) as worker,
        Client(server.url, SERVER_LAYOUT, name=SCHEDULER) as sched,
    ):
        assert worker.store(prompt[:40], kv[:, :, :40]).num_new_chunks == 3  # 40 new tokens
        assert worker.store(prompt, kv[:, :, 32:], start=32).num_new_chunks == 2  # 16 + 12 new tokens
        assert worker.store(prompt[:45], kv[:, :, :45]).num_new_chunks == 1  # only [32, 45) is new: 13 tokens
        assert worker.store(prompt[:40], kv[:, :, :40]).num_new_chunks == 0
        worker.flush()  # registrations done: nothing shields the chunk evicted next
        middle = prefix_keys(SERVER_LAYOUT.namespace, as_token_array(prompt), CHUNK_SIZE)[1]
        assert worker.evict([middle]) >= 1 and worker.chunk(middle).tiers == ()
        assert worker.store(prompt, kv).num_new_chunks == 1  # chunk 1 again (16); the partial last one is held
        plan = worker.lookup(prompt)
        assert worker.retrieve(plan).num_prefix_tokens == 60
        for tokens in (prompt, make_tokens(30, seed=92)):
            sched.release(sched.lookup(tokens))
    values = scrape(server)
    stored_tokens = 40 + 28 + 13 + 0 + 16
    worker_values = engine_values(values, WORKER)
    assert worker_values['kvstore_engine_tokens_total{direction="stored"}'] == stored_tokens
    assert worker_values['kvstore_engine_bytes_total{direction="stored"}'] == bytes_of(stored_tokens)
    assert worker_values['kvstore_engine_tokens_total{direction="retrieved"}'] == 60
    assert worker_values['kvstore_engine_bytes_total{direction="retrieved"}'] == bytes_of(60)
    assert worker_values["kvstore_engine_lookups_total"] == 1
    assert worker_values["kvstore_engine_lookup_tokens_total"] == 60
    assert worker_values["kvstore_engine_hit_tokens_total"] == 60
    assert worker_values["kvstore_engine_store_seconds_count"] == 5
    assert worker_values["kvstore_engine_retrieve_seconds_count"] == 1
    assert worker_values["kvstore_engine_lookup_seconds_count"] == 1
    assert 0 < worker_values["kvstore_engine_store_seconds_sum"] < 60
    scheduler_values = engine_values(values, SCHEDULER)
    assert scheduler_values["kvstore_engine_lookups_total"] == 2
    assert scheduler_values["kvstore_engine_lookup_tokens_total"] == 60 + 30
    assert scheduler_values["kvstore_engine_hit_tokens_total"] == 60, "the prompt's cached prefix, nothing of the other"
    assert scheduler_values["kvstore_engine_lookup_seconds_count"] == 2
    assert scheduler_values['kvstore_engine_tokens_total{direction="stored"}'] == 0
    assert scheduler_values["kvstore_engine_store_seconds_count"] == 0
    assert values["kvstore_lookup_seconds_count"] >= 3, "the global series count every engine's requests too"


def test_a_sixty_fifth_name_counts_under_other(caplog: pytest.LogCaptureFixture) -> None:
    metrics = ServerMetrics(lambda: None, lambda: 0)
    coverage = PlanCoverage.of(LookupPlan(plan_id=1, session_id=None, num_query_tokens=10, segments=()), CHUNK_SIZE)
    with caplog.at_level(logging.WARNING, logger="kvstore.server.metrics"):
        for index in range(MAX_ENGINES + 6):
            engine = metrics.add_client(f"client-{index}", f"engine {index}")
            metrics.observe_lookup(coverage, 0.001, engine)
        metrics.observe_lookup(coverage, 0.001, metrics.add_client("again", "engine 3"))  # a known name keeps its own
    text = metrics.exposition().decode()
    engines = {
        line.split('engine="')[1].split('"')[0]
        for line in text.splitlines()
        if line.startswith("kvstore_engine_lookups_total")
    }
    assert len(engines) == MAX_ENGINES + 1 and OTHER_ENGINE in engines and f"engine {MAX_ENGINES}" not in engines
    assert f'kvstore_engine_lookups_total{{engine="{OTHER_ENGINE}"}} 6.0' in text
    assert 'kvstore_engine_lookups_total{engine="engine 3"} 2.0' in text
    assert 'kvstore_engine_lookup_tokens_total{engine="engine 3"} 20.0' in text
    assert [record.levelno for record in caplog.records] == [logging.WARNING], "logged once, not per folded name"
    assert f"'engine {MAX_ENGINES}'" in caplog.records[0].getMessage()
    assert metrics.engine_of("client-0").engine == "engine 0"
    metrics.forget_client("client-0")
    assert metrics.engine_of("client-0").engine == OTHER_ENGINE


def test_plan_coverage_counts_the_exact_prefix_up_to_the_first_gap_or_blend_segment() -> None:
    def segment(start: int, num_tokens: int, exact: bool) -> Segment:
        return Segment(start=start, num_tokens=num_tokens, key=PrefixKey(bytes([start]) * 16), source_start=start,
                       exact=exact, tier=TierName.CPU)  # fmt: skip

    for segments, expected in [
        ((segment(0, 16, True), segment(16, 16, True), segment(48, 16, True)), 32),  # a gap at 32
        ((segment(0, 16, True), segment(16, 16, False), segment(32, 16, True)), 16),  # a blend segment at 16
        ((segment(16, 16, True),), 0),  # nothing at 0
        ((segment(0, 16, True), segment(16, 5, True)), 21),
    ]:
        plan = LookupPlan(plan_id=1, session_id=None, num_query_tokens=80, segments=segments)
        assert PlanCoverage.of(plan, CHUNK_SIZE).num_prefix_tokens == plan.num_prefix_tokens == expected


def test_departed_clients_are_forgotten_by_the_engine_table(tmp_path: Path) -> None:
    """Goodbye, a dead process and a remote client idle past the TTL all drop the client's id (its name's series
    stay); an admin client takes no engine label."""
    now, alive = [1000.0], {4242, 4343}
    host = StoreHost(StoreConfig(tiers=(TierName.CPU,), chunk_size=CHUNK_SIZE, cpu_capacity_bytes=1 << 20), None)
    clients = ClientRegistry(clock=lambda: now[0], pid_alive=lambda pid: pid in alive)
    metrics = ServerMetrics(lambda: None, lambda: clients.num_clients)
    limits = Limits()
    identity = ServerIdentity(version="t", host_id="h", pid=1, started_s=time.monotonic(), limits=limits, shm=False,
                              data_dir=None)  # fmt: skip
    handler = RequestHandler(host, clients, identity, metrics, is_serving=lambda: True)

    def request(op: Op, args: dict[str, object], client_id: str | None = None) -> str:
        reply = handler.handle(decode_request([memoryview(encode_request(1, op, client_id, args))], limits))
        decoded = decode_reply([memoryview(reply.header)])
        assert decoded.ok and decoded.result is not None, decoded.error_message
        return decoded.result.required_str("client_id", 64) if op is Op.HELLO else ""

    def hello(name: str, pid: int, host_id: str = "h", layout: bool = True) -> str:
        layout_json = SERVER_LAYOUT.to_json() if layout else None
        return request(
            Op.HELLO, HelloArgs(layout_json=layout_json, client_name=name, pid=pid, host_id=host_id).to_wire()
        )

    try:
        leaving, dying, remote = hello("leaving", 4242), hello("dying", 4343), hello("remote", 1, host_id="far")
        admin = hello("admin", 4242, layout=False)
        assert [metrics.engine_of(c).engine for c in (leaving, dying, remote, admin)] == [
            "leaving", "dying", "remote", OTHER_ENGINE,
        ]  # fmt: skip
        request(Op.GOODBYE, {}, leaving)
        alive.discard(4343)
        now[0] += 601
        handler.janitor_pass(plan_ttl_s=600)
        assert [metrics.engine_of(c).engine for c in (leaving, dying, remote)] == [OTHER_ENGINE] * 3
        assert metrics.engine_of(hello("leaving", 4242)).engine == "leaving", "a name keeps its label once it has one"
    finally:
        host.close()
