"""``RequestHandler`` in process, over a real ``TieredStore``: every op's success and failure replies, the janitor's
rules (dead clients, plan TTL), the bug boundary, and the error-code mapping. No sockets: the requests are the
same bytes a client sends."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgpack
import pytest
import torch

from kvstore import ConfigError, StoreConfig
from kvstore.errors import (
    CapacityError,
    InvalidInputError,
    KVStoreError,
    LayoutMismatchError,
    ProtocolError,
    ServerBusyError,
    ServerUnavailableError,
    StorageError,
    StoreClosedError,
)
from kvstore.keys import as_token_array
from kvstore.layout import KVLayout
from kvstore.server.clients import ClientRegistry
from kvstore.server.handlers import ReplyFrames, RequestHandler, ServerIdentity
from kvstore.server.metrics import ServerMetrics
from kvstore.server.store_host import StoreHost
from kvstore.server.usage.documents_file import load_document_hits
from kvstore.tiers.base import TierName
from kvstore.wire.documents import DocumentsArgs, DocumentsReport, TierChunks
from kvstore.wire.error_codes import ErrorCode, error_for, exception_for
from kvstore.wire.messages import (
    EvictArgs,
    HelloArgs,
    InlineBulk,
    LookupArgs,
    RetrieveArgs,
    ShmBulk,
    StoreArgs,
)
from kvstore.wire.protocol import Limits, Op, decode_reply, decode_request, encode_request
from kvstore.wire.values import RetrievedSegments
from tests.factories import make_kv, make_tokens
from tests.server.conftest import CHUNK_SIZE, SERVER_LAYOUT

LIMITS = Limits(max_payload_bytes=64 * 1024)


@dataclass
class Harness:
    """A handler over a real store, with a clock and a pid table the test controls."""

    handler: RequestHandler
    host: StoreHost
    clients: ClientRegistry
    metrics: ServerMetrics
    now: list[float]
    alive: set[int]

    def send(self, op: Op, args: dict[str, object], client: str | None = None, payload: bytes | None = None):
        frames = [memoryview(encode_request(1, op, client, args))]
        if payload is not None:
            frames.append(memoryview(payload))
        reply = self.handler.handle(decode_request(frames, LIMITS))
        return decode_reply(_frames(reply)), reply

    def ok(self, op: Op, args: dict[str, object], client: str | None = None, payload: bytes | None = None):
        reply, raw = self.send(op, args, client, payload)
        assert reply.ok, f"{op}: {reply.error_code} {reply.error_message}"
        assert reply.result is not None
        return reply.result, raw

    def code(self, op: Op, args: dict[str, object], client: str | None = None, payload: bytes | None = None) -> str:
        reply, _ = self.send(op, args, client, payload)
        assert not reply.ok and "\n" not in reply.error_message
        return reply.error_code

    def hello(self, layout: KVLayout | None = SERVER_LAYOUT, pid: int = 4242) -> str:
        self.alive.add(pid)
        args = HelloArgs(layout_json=layout.to_json() if layout else None, client_name="t", pid=pid, host_id="h")
        result, _ = self.ok(Op.HELLO, args.to_wire())
        return result.required_str("client_id", 64)


def _frames(reply: ReplyFrames) -> list[memoryview]:
    frames = [memoryview(reply.header)]
    if reply.payload is not None:
        frames.append(memoryview(reply.payload))
    return frames


def make_harness(config: StoreConfig, layout: KVLayout | None, **handler_options: object) -> Harness:
    now = [1000.0]
    alive: set[int] = set()
    host = StoreHost(config, layout)
    clients = ClientRegistry(clock=lambda: now[0], pid_alive=lambda pid: pid in alive)

    def stats():  # type: ignore[no-untyped-def]
        return host.store.stats() if host.store is not None else None

    metrics = ServerMetrics(stats, lambda: clients.num_clients)
    data_dir = str(config.data_dir) if TierName.DISK in config.tiers else None
    identity = ServerIdentity(
        version="test", host_id="h", pid=1, started_s=time.monotonic(), limits=LIMITS, shm=True, data_dir=data_dir
    )
    handler = RequestHandler(host, clients, identity, metrics, is_serving=lambda: True, **handler_options)  # type: ignore[arg-type]
    return Harness(handler, host, clients, metrics, now, alive)


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    config = StoreConfig(
        tiers=(TierName.CPU, TierName.DISK), chunk_size=CHUNK_SIZE, cpu_capacity_bytes=1 << 20,
        data_dir=tmp_path / "data", disk_capacity_bytes=1 << 26, enable_blend=True,
    )  # fmt: skip
    built = make_harness(config, SERVER_LAYOUT)
    yield built
    built.host.close()


def kv_bytes(num_tokens: int, seed: int) -> tuple[torch.Tensor, bytes]:
    kv = make_kv(SERVER_LAYOUT, num_tokens, seed)
    return kv, kv.view(torch.uint8).numpy().tobytes()


def test_store_lookup_retrieve_inline(harness: Harness) -> None:
    client = harness.hello()
    tokens = as_token_array(make_tokens(40, seed=3))
    _, payload = kv_bytes(40, 3)
    store = StoreArgs(tokens=tokens, bulk=InlineBulk(), durable=True).to_wire()
    result, _ = harness.ok(Op.STORE, store, client, payload)
    assert result.required_int("num_new_chunks", 0, 99) == 3
    assert harness.code(Op.STORE, store, client, payload[:-2]) == ErrorCode.INVALID_ARGUMENT
    assert harness.code(Op.STORE, store, client) == ErrorCode.MALFORMED  # inline without payload
    plan, _ = harness.ok(Op.LOOKUP, LookupArgs(tokens=tokens, session_id=None, blend=None).to_wire(), client)
    plan_id = plan.required_int("plan_id", 0, 2**62)
    _, raw = harness.ok(Op.RETRIEVE, RetrieveArgs(plan_id=plan_id, bulk=InlineBulk()).to_wire(), client)
    assert raw.payload is not None and bytes(raw.payload) == payload
    assert harness.code(Op.RETRIEVE, RetrieveArgs(plan_id=plan_id, bulk=InlineBulk()).to_wire(), client) == (
        ErrorCode.UNKNOWN_PLAN
    )
    assert harness.code(Op.RELEASE, {"plan_id": plan_id}, client) == ErrorCode.UNKNOWN_PLAN
    exposition = harness.metrics.exposition().decode()
    assert "kvstore_blend_index_entries" in exposition and 'kvstore_lookup_chunks_total{tier="cpu"} 3.0' in exposition
    assert 'kvstore_tier_hits_total{tier="cpu"} 3.0' in exposition, "one definition of a hit: planned chunks"


def test_a_memory_only_retrieve_skips_what_only_the_disk_holds(tmp_path: Path) -> None:
    config = StoreConfig(tiers=(TierName.DISK,), chunk_size=CHUNK_SIZE, data_dir=tmp_path / "data",
                         disk_capacity_bytes=1 << 26)  # fmt: skip
    harness = make_harness(config, SERVER_LAYOUT)
    try:
        client = harness.hello()
        tokens = as_token_array(make_tokens(32, seed=6))
        _, payload = kv_bytes(32, 6)
        harness.host.require().store(tokens, make_kv(SERVER_LAYOUT, 32, seed=6))
        lookup = LookupArgs(tokens=tokens, session_id=None, blend=None).to_wire()
        retrieved = []
        for memory_only in (True, False):
            plan, _ = harness.ok(Op.LOOKUP, lookup, client)
            retrieve = RetrieveArgs(plan_id=plan.required_int("plan_id", 0, 2**62), bulk=InlineBulk(),
                                    memory_only=memory_only)  # fmt: skip
            result, raw = harness.ok(Op.RETRIEVE, retrieve.to_wire(), client)
            retrieved.append((RetrievedSegments.from_wire(result), raw.payload))
        (skipped, _), (loaded, loaded_payload) = retrieved
        assert skipped.segments == () and skipped.end == 0, "only the disk holds the chunks"
        assert len(loaded.segments) == 32 // CHUNK_SIZE
        assert loaded_payload is not None and bytes(loaded_payload) == payload
        assert "memory_only" not in RetrieveArgs(plan_id=1, bulk=InlineBulk()).to_wire(), "old servers refuse it"
    finally:
        harness.host.close()


def test_inline_retrieves_over_the_limit_are_refused_and_release_the_plan(harness: Harness) -> None:
    client = harness.hello()
    tokens = as_token_array(make_tokens(300, seed=4))
    buffer = ShmBulk(segment_id=1, offset=0, nbytes=SERVER_LAYOUT.chunk_bytes(300))
    assert harness.code(Op.STORE, StoreArgs(tokens=tokens, bulk=buffer, durable=False).to_wire(), client) == (
        ErrorCode.UNKNOWN_SEGMENT
    )
    store = harness.host.require()
    store.store(tokens, make_kv(SERVER_LAYOUT, 300, seed=4))
    plan, _ = harness.ok(Op.LOOKUP, LookupArgs(tokens=tokens, session_id="s", blend=False).to_wire(), client)
    retrieve = RetrieveArgs(plan_id=plan.required_int("plan_id", 0, 2**62), bulk=InlineBulk()).to_wire()
    assert harness.code(Op.RETRIEVE, retrieve, client) == ErrorCode.TOO_LARGE
    assert store.stats().num_open_plans == 0, "the refused plan's pins were released"


def test_a_retrieve_from_start_replies_with_the_tail_and_a_start_past_the_plan_releases_it(harness: Harness) -> None:
    client = harness.hello()
    tokens = as_token_array(make_tokens(40, seed=7))
    kv, _ = kv_bytes(40, 7)
    store = harness.host.require()
    store.store(tokens, kv)
    lookup = LookupArgs(tokens=tokens, session_id=None, blend=None).to_wire()
    plan, _ = harness.ok(Op.LOOKUP, lookup, client)
    retrieve = RetrieveArgs(plan_id=plan.required_int("plan_id", 0, 2**62), bulk=InlineBulk(), start=CHUNK_SIZE + 3)
    result, raw = harness.ok(Op.RETRIEVE, retrieve.to_wire(), client)
    loaded = RetrievedSegments.from_wire(result)
    assert [segment.start for segment in loaded.segments] == [CHUNK_SIZE, 2 * CHUNK_SIZE] and loaded.end == 40
    tail = kv[:, :, CHUNK_SIZE + 3 :].contiguous()
    assert raw.payload is not None and bytes(raw.payload) == tail.view(torch.uint8).numpy().tobytes()
    plan, _ = harness.ok(Op.LOOKUP, lookup, client)
    past = RetrieveArgs(plan_id=plan.required_int("plan_id", 0, 2**62), bulk=InlineBulk(), start=41)
    assert harness.code(Op.RETRIEVE, past.to_wire(), client) == ErrorCode.INVALID_ARGUMENT
    assert store.stats().num_open_plans == 0, "the refused plan's pins were released"
    assert "start" not in RetrieveArgs(plan_id=1, bulk=InlineBulk()).to_wire(), "sent only when not 0"


def test_admin_ops_and_their_errors(harness: Harness) -> None:
    client = harness.hello()
    admin = harness.hello(layout=None, pid=4343)
    tokens = as_token_array(make_tokens(32, seed=5))
    harness.host.require().store(tokens, make_kv(SERVER_LAYOUT, 32, seed=5))
    plan = harness.host.require().lookup(tokens)
    harness.host.require().release(plan)
    harness.host.require().flush()  # write-throughs and registrations hold pins until done
    key = plan.segments[0].key
    result, _ = harness.ok(Op.CHUNK, {"key": bytes(key)}, admin)
    assert result.list_("tiers", 3) == ["cpu", "disk"]
    assert harness.code(Op.LOOKUP, LookupArgs(tokens=tokens, session_id=None, blend=None).to_wire(), admin) == (
        ErrorCode.CONFIG
    )
    result, _ = harness.ok(Op.EVICT, EvictArgs(num_bytes=1 << 30, tier=TierName.CPU).to_wire(), admin)
    assert result.required_int("freed_bytes", 0, 2**62) > 0
    assert harness.code(Op.EVICT, EvictArgs(num_bytes=1, tier=TierName.GPU).to_wire(), admin) == ErrorCode.CONFIG
    harness.ok(Op.END_SESSION, {"session_id": "none"}, client)
    harness.ok(Op.FLUSH, {}, admin)
    harness.ok(Op.STATS, {}, admin)
    result, _ = harness.ok(Op.INFO, {}, admin)
    assert len(result.list_("clients", 10)) == 2
    assert harness.code(Op.ATTACH, {"name": "kvstore-1-" + "a" * 16, "nbytes": 64, "fd": 3}, client) == (
        ErrorCode.INVALID_ARGUMENT  # another pid's segment
    )
    result, _ = harness.ok(Op.DETACH, {"segment_id": 5}, client)
    assert result.required_bool("detached") is False
    harness.ok(Op.GOODBYE, {}, client)
    assert harness.code(Op.STATS, {}, client) == ErrorCode.NOT_REGISTERED
    layout = KVLayout(model_id="other", num_layers=2, num_kv_heads=2, head_dim=16)
    args = HelloArgs(layout_json=layout.to_json(), client_name="x", pid=1, host_id="").to_wire()
    assert harness.code(Op.HELLO, args) == ErrorCode.LAYOUT_MISMATCH
    remote = harness.ok(Op.HELLO, args | {"layout": None})[0].required_str("client_id", 64)
    assert harness.code(Op.ATTACH, {"name": "kvstore-1-" + "a" * 16, "nbytes": 64, "fd": 3}, remote) == ErrorCode.CONFIG


def test_documents_op_counts_stores_and_lookups_and_the_janitor_saves_them(tmp_path: Path) -> None:
    config = StoreConfig(
        tiers=(TierName.CPU, TierName.DISK), chunk_size=CHUNK_SIZE, cpu_capacity_bytes=1 << 20,
        data_dir=tmp_path / "data", disk_capacity_bytes=1 << 26,
    )  # fmt: skip
    harness = make_harness(config, SERVER_LAYOUT, documents_save_interval_s=0.0)
    try:
        client, admin = harness.hello(), harness.hello(layout=None, pid=4343)
        tokens = as_token_array(make_tokens(40, seed=7))
        _, payload = kv_bytes(40, 7)
        harness.ok(Op.STORE, StoreArgs(tokens=tokens, bulk=InlineBulk(), durable=True).to_wire(), client, payload)
        for _ in range(3):
            plan, _ = harness.ok(Op.LOOKUP, LookupArgs(tokens=tokens, session_id=None, blend=None).to_wire(), client)
            harness.ok(Op.RELEASE, {"plan_id": plan.required_int("plan_id", 0, 2**62)}, client)
        result, _ = harness.ok(Op.DOCUMENTS, DocumentsArgs(top=5).to_wire(), admin)
        report = DocumentsReport.from_wire(result)
        (document,) = report.documents
        assert (document.num_chunks, document.num_tokens, document.num_hits, document.num_tokens_served) == (
            3, 40, 3, 120,
        )  # fmt: skip
        assert {held.tier: held.num_chunks for held in document.tiers} == {TierName.CPU: 3, TierName.DISK: 3}
        assert document.first_tokens == tuple(int(t) for t in tokens[:16]) and document.last_hit is not None
        assert (report.num_tracked, report.num_dropped) == (1, 0)
        assert harness.code(Op.DOCUMENTS, {"top": 0}, admin) == ErrorCode.INVALID_ARGUMENT
        assert harness.code(Op.DOCUMENTS, {"top": 5, "extra": 1}, admin) == ErrorCode.INVALID_ARGUMENT
        harness.handler.janitor_pass(plan_ttl_s=600)
        saved = load_document_hits(tmp_path / "data")
        assert saved is not None and [d.num_hits for d in saved.documents] == [3]
    finally:
        harness.host.close()
    reopened = make_harness(config, SERVER_LAYOUT)
    try:
        admin = reopened.hello(layout=None, pid=4343)
        result, _ = reopened.ok(Op.DOCUMENTS, DocumentsArgs(top=5).to_wire(), admin)
        (restored,) = DocumentsReport.from_wire(result).documents
        assert (restored.first_key, restored.num_hits, restored.last_hit_ns) == (
            document.first_key, 3, document.last_hit_ns,
        ), "a restarted server keeps its counts"  # fmt: skip
        assert restored.tiers == (TierChunks(tier=TierName.DISK, num_chunks=3),), "after a restart only the disk has it"
    finally:
        reopened.host.close()


def test_the_janitor_releases_dead_clients_and_expired_plans(harness: Harness) -> None:
    tokens = as_token_array(make_tokens(32, seed=6))
    store = harness.host.require()
    store.store(tokens, make_kv(SERVER_LAYOUT, 32, seed=6))
    dying, forgetful = harness.hello(pid=5001), harness.hello(pid=5002)
    for session in ("a", "b", None):
        harness.ok(Op.LOOKUP, LookupArgs(tokens=tokens, session_id=session, blend=None).to_wire(), dying)
    harness.ok(Op.LOOKUP, LookupArgs(tokens=tokens, session_id=None, blend=None).to_wire(), forgetful)
    assert store.stats().num_open_plans == 4
    harness.alive.discard(5001)
    harness.handler.janitor_pass(plan_ttl_s=600)
    assert store.stats().num_open_plans == 1 and harness.clients.num_clients == 1
    harness.now[0] += 601
    harness.handler.janitor_pass(plan_ttl_s=600)
    assert store.stats().num_open_plans == 0 and store.stats().num_sessions == 0
    remote = harness.ok(Op.HELLO, {"layout": None, "client_name": "r", "pid": 1, "host_id": "elsewhere"})[0]
    remote_id = remote.required_str("client_id", 64)
    harness.now[0] += 601
    harness.handler.janitor_pass(plan_ttl_s=600)
    assert harness.code(Op.STATS, {}, remote_id) == ErrorCode.NOT_REGISTERED, "an idle remote client is forgotten"
    assert harness.clients.num_clients == 1, "a live local client is kept however idle"


def test_a_bug_is_an_internal_reply_not_a_dead_worker(harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    client = harness.hello()
    store = harness.host.require()

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(store, "stats", broken)
    assert harness.code(Op.STATS, {}, client) == ErrorCode.INTERNAL
    monkeypatch.undo()
    assert 'outcome="internal"' in harness.metrics.exposition().decode()


def test_a_memory_only_server_refuses_durable_stores(tmp_path: Path) -> None:
    config = StoreConfig(tiers=(TierName.CPU,), chunk_size=CHUNK_SIZE, cpu_capacity_bytes=1 << 20)
    built = make_harness(config, None)
    try:
        assert built.code(Op.STATS, {}, "nobody") == ErrorCode.NOT_REGISTERED
        admin = built.hello(layout=None)
        assert msgpack.packb(built.ok(Op.STATS, {}, admin)[0].list_("tiers", 3)) == msgpack.packb([])
        assert built.code(Op.FLUSH, {}, admin) == ErrorCode.CONFIG  # no layout registered yet
        client = built.hello()
        _, payload = kv_bytes(16, 7)
        store = StoreArgs(tokens=as_token_array(make_tokens(16)), bulk=InlineBulk(), durable=True).to_wire()
        assert built.code(Op.STORE, store, client, payload) == ErrorCode.CONFIG
    finally:
        built.host.close()


@pytest.mark.parametrize(
    ("error", "code", "client_class"),
    [
        (InvalidInputError("x"), ErrorCode.INVALID_ARGUMENT, InvalidInputError),
        (LayoutMismatchError("x"), ErrorCode.LAYOUT_MISMATCH, LayoutMismatchError),
        (ConfigError("x"), ErrorCode.CONFIG, ConfigError),
        (CapacityError("x"), ErrorCode.CAPACITY, CapacityError),
        (StorageError("x"), ErrorCode.STORAGE, StorageError),
        (StoreClosedError("x"), ErrorCode.SHUTTING_DOWN, ServerUnavailableError),
        (KVStoreError("x"), ErrorCode.INTERNAL, KVStoreError),
    ],
)
def test_errors_travel_as_codes_and_come_back_as_the_same_family(
    error: KVStoreError, code: ErrorCode, client_class: type[KVStoreError]
) -> None:
    reply = error_for(error)
    assert reply.code is code
    assert type(exception_for(code.value, reply.message)) is client_class
    assert isinstance(exception_for(ErrorCode.BUSY.value, "m"), ServerBusyError)
    assert isinstance(exception_for(ErrorCode.MALFORMED.value, "m"), ProtocolError)
