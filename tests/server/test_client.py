"""``kvstore.Client`` against real ``kvstore serve`` processes: the ``TieredStore`` surface, bulk KV through shared
memory and inline, sessions and pins, errors, restarts, and a client killed with -9 leaking nothing."""

from __future__ import annotations

import gc
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore import Client, ConfigError, InvalidInputError, KVLayout, LayoutMismatchError, ServerUnavailableError
from kvstore.plan import UNPINNED_PLAN_ID
from kvstore.tiers.base import TierName
from tests.factories import make_kv, make_tokens
from tests.server.conftest import CHUNK_SIZE, REPO_ROOT, SERVER_LAYOUT, ServerProcess, running_server, segments_mapped

pytestmark = pytest.mark.slow


def wait_until(condition: object, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_store_lookup_retrieve_round_trip(server: ServerProcess, transport: str) -> None:
    tokens, kv = make_tokens(100, seed=11 + len(transport)), make_kv(SERVER_LAYOUT, 100, seed=1)
    with Client(server.url, SERVER_LAYOUT, transport=transport) as client:
        result = client.store(tokens, kv)
        assert (result.num_chunks, result.num_new_chunks) == (7, 7)
        assert client.store(tokens, kv).num_new_chunks == 0
        plan = client.lookup(np.concatenate([tokens, [1, 2, 3]]))
        assert [(s.start, s.num_tokens, s.exact) for s in plan.segments][-1] == (96, 4, True)
        assert plan.num_prefix_tokens == 100 and [(g.start, g.end) for g in plan.gaps] == [(100, 103)]
        retrieved = client.retrieve(plan)
        assert torch.equal(retrieved.kv, kv) and retrieved.num_prefix_tokens == 100
        out = torch.zeros(SERVER_LAYOUT.chunk_shape(120), dtype=torch.bfloat16)
        into = client.retrieve(client.lookup(tokens), out)
        assert torch.equal(out[:, :, :100], kv) and into.kv.data_ptr() == out.data_ptr()
        in_memory = client.retrieve(client.lookup(tokens), memory_only=True)  # the cpu tier holds every chunk
        assert torch.equal(in_memory.kv, kv) and in_memory.num_prefix_tokens == 100
        assert client.stats().num_open_plans == 0


def test_documents_in_another_order_come_back_as_blend_segments(server: ServerProcess) -> None:
    doc_a, doc_b = make_tokens(32, seed=21), make_tokens(32, seed=22)
    kv_a, kv_b = make_kv(SERVER_LAYOUT, 32, seed=21), make_kv(SERVER_LAYOUT, 32, seed=22)
    with Client(server.url, SERVER_LAYOUT) as client:
        client.store(doc_a, kv_a)
        client.store(doc_b, kv_b)
        client.flush()  # registrations run after the store returns
        plan = client.lookup(np.concatenate([[7, 7, 7], doc_b, doc_a]), blend=True)
        assert [(s.start, s.source_start, s.exact) for s in plan.segments] == [
            (3, 0, False), (19, 16, False), (35, 0, False), (51, 16, False)
        ]  # fmt: skip
        result = client.retrieve(plan)
        assert torch.equal(result.kv[:, :, 3:35], kv_b) and torch.equal(result.kv[:, :, 35:67], kv_a)


def test_buffers_move_no_bytes_on_the_client_side(server: ServerProcess) -> None:
    tokens = make_tokens(40, seed=31)
    with Client(server.url, SERVER_LAYOUT) as client:
        source = client.buffer(64)
        source.copy_(make_kv(SERVER_LAYOUT, 64, seed=31))
        client.store(tokens, source[:, :, :40])  # a [:, :, :n] view of a buffer goes by reference
        target = client.buffer(48)
        result = client.retrieve(client.lookup(tokens), target)
        assert result.kv.data_ptr() == target.data_ptr(), "written in place by the server"
        assert torch.equal(target[:, :, :40], source[:, :, :40])
        assert client.info().clients[-1].num_segments >= 2


def test_sessions_release_their_pins(server: ServerProcess) -> None:
    tokens, kv = make_tokens(64, seed=41), make_kv(SERVER_LAYOUT, 64, seed=41)
    with Client(server.url, SERVER_LAYOUT) as client:
        client.store(tokens, kv)
        with client.session() as session:
            plans = [session.lookup(tokens) for _ in range(3)]
            assert client.stats().num_open_plans == 3
            session.retrieve(plans[0])
        assert client.stats().num_open_plans == 0
        abandoned = client.session()
        abandoned.lookup(tokens)
        del abandoned
        gc.collect()
        assert client.stats().num_open_plans == 0, "a garbage-collected session ends on the server too"
        plan = client.lookup(tokens)
        client.release(plan)
        client.release(plan)  # idempotent
        with pytest.raises(ConfigError, match="already retrieved or released"):
            client.retrieve(plan)
        mine = client.lookup(tokens)
        with Client(server.url, SERVER_LAYOUT) as other, pytest.raises(ConfigError, match="another client"):
            other.retrieve(mine)
        client.retrieve(mine)


def test_an_unpinned_lookup_is_one_round_trip_that_leaves_no_pins(server: ServerProcess) -> None:
    """``pin=False`` (the connector's scheduler probe): the same segments as a pinned lookup, no plan left open,
    nothing to retrieve, and a release that sends nothing."""
    tokens, kv = make_tokens(64, seed=43), make_kv(SERVER_LAYOUT, 64, seed=43)
    with Client(server.url, SERVER_LAYOUT) as client:
        client.store(tokens, kv)
        before = client.stats().num_open_plans
        looked = client.lookup(tokens, pin=False)
        pinned = client.lookup(tokens)
        assert looked.segments == pinned.segments and looked.num_prefix_tokens == 64
        assert looked.plan_id == UNPINNED_PLAN_ID != pinned.plan_id
        assert client.stats().num_open_plans == before + 1, "only the pinned lookup holds a plan"
        releases = release_requests(server)
        client.release(looked)
        assert release_requests(server) == releases, "releasing an unpinned plan sends nothing"
        with pytest.raises(ConfigError, match="already retrieved or released"):
            client.retrieve(looked)
        client.release(pinned)
        assert release_requests(server) == releases + 1
        assert client.stats().num_open_plans == before


def test_a_plan_is_handed_to_another_client_by_the_owners_token(server: ServerProcess) -> None:
    """One process pins (a vLLM scheduler), another loads (its worker): the worker's client retrieves or releases
    the plan under the owner's token, its KV landing in the worker's own memory; a wrong token names nothing."""
    tokens, kv = make_tokens(64, seed=44), make_kv(SERVER_LAYOUT, 64, seed=44)
    with Client(server.url, SERVER_LAYOUT) as scheduler, Client(server.url, SERVER_LAYOUT) as worker:
        scheduler.store(tokens, kv)
        before = scheduler.stats().num_open_plans
        handed = scheduler.lookup(tokens)
        result = worker.retrieve(handed, owner=scheduler.client_token)
        assert torch.equal(result.kv, kv) and scheduler.stats().num_open_plans == before
        released = scheduler.lookup(tokens)
        worker.release(released, owner=scheduler.client_token)
        assert scheduler.stats().num_open_plans == before
        kept = scheduler.lookup(tokens)
        with pytest.raises(ConfigError, match="another client"):
            worker.retrieve(kept, owner=worker.client_token)
        scheduler.retrieve(kept)


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_a_retrieve_from_start_moves_only_the_tokens_after_it(server: ServerProcess, transport: str) -> None:
    """An engine whose own prefix cache holds ``[0, start)`` retrieves from ``start``: the bytes that travel (the
    server's bulk count) are the tail's, into a buffer sized for the tail; a start past the plan is refused before
    anything is sent."""
    num_tokens, start = 3 * CHUNK_SIZE + 5, CHUNK_SIZE + 7
    tokens, kv = make_tokens(num_tokens, seed=45), make_kv(SERVER_LAYOUT, num_tokens, seed=45)
    with Client(server.url, SERVER_LAYOUT, transport=transport) as client:
        client.store(tokens, kv)
        before = retrieved_bytes(server, transport)
        out = client.buffer(num_tokens - start) if transport == "shm" else None
        result = client.retrieve(client.lookup(tokens), out, start=start)
        assert torch.equal(result.kv, kv[:, :, start:]) and result.num_prefix_tokens == num_tokens
        assert [segment.start for segment in result.segments] == [CHUNK_SIZE, 2 * CHUNK_SIZE, 3 * CHUNK_SIZE]
        assert retrieved_bytes(server, transport) - before == SERVER_LAYOUT.chunk_bytes(num_tokens - start)
        plan = client.lookup(tokens)
        with pytest.raises(InvalidInputError, match="outside the plan"):
            client.retrieve(plan, start=num_tokens + 1)
        assert torch.equal(client.retrieve(plan, start=num_tokens).kv, kv[:, :, :0]), "refused before it was sent"


def retrieved_bytes(server: ServerProcess, transport: str) -> float:
    """The server's count of KV bytes retrieved through ``transport`` (its metrics endpoint)."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    prefix = f'kvstore_bulk_bytes_total{{direction="retrieved",transport="{transport}"}} '
    return sum(float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix))


def release_requests(server: ServerProcess) -> float:
    """The server's count of release requests answered (its metrics endpoint)."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    prefix = 'kvstore_requests_total{op="release",outcome="ok"} '
    return sum(float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix))


def test_lookups_on_the_io_thread_and_on_the_control_pool_agree(server: ServerProcess) -> None:
    """Issue 5: a lookup whose header fits in 128 KiB is answered on the server's I/O thread, a longer one on the
    control pool; both plan the same cached chunks and hold their pins only until released or retrieved."""
    prefix, kv = make_tokens(64, seed=51), make_kv(SERVER_LAYOUT, 64, seed=51)
    with Client(server.url, SERVER_LAYOUT) as client:
        client.store(prefix, kv)
        short = client.lookup(np.concatenate([prefix, make_tokens(100, seed=52)]))
        long = client.lookup(np.concatenate([prefix, make_tokens(40_000, seed=52)]))  # 160 KB of token ids
        assert short.segments == long.segments and short.num_prefix_tokens == long.num_prefix_tokens == 64
        assert [(gap.start, gap.end) for gap in long.gaps] == [(64, 40_064)]
        assert client.stats().num_open_plans == 2
        client.release(short)
        assert torch.equal(client.retrieve(long).kv, kv)
        assert client.stats().num_open_plans == 0 and client.health().status == "serving"


def test_admin_clients_inspect_and_evict(server: ServerProcess) -> None:
    tokens, kv = make_tokens(32, seed=51), make_kv(SERVER_LAYOUT, 32, seed=51)
    with Client(server.url, SERVER_LAYOUT) as client, Client(server.url) as admin:
        client.store(tokens, kv, durable=True)
        key = client.lookup(tokens).segments[0].key
        info = admin.info()
        assert info.layout == SERVER_LAYOUT and info.chunk_size == CHUNK_SIZE and info.features.blend
        assert admin.chunk(key).tiers == (TierName.CPU, TierName.DISK) and admin.chunk(key).hits >= 1
        with pytest.raises(InvalidInputError, match="admin"):
            admin.store(tokens, kv)
        client.end_session("nothing")  # unknown sessions are fine
        assert admin.stats().num_open_plans == 1
        assert admin.evict([key]) == 1, "only the disk copy goes: the cpu copy is pinned by the open plan"
        assert admin.chunk(key).tiers == (TierName.CPU,)
        client.close()
        assert wait_until(lambda: admin.stats().num_open_plans == 0), "goodbye releases the client's plans"
        assert admin.evict([key]) == 1 and admin.chunk(key).tiers == ()
        assert admin.evict_bytes(1 << 30, TierName.CPU) >= 0
        with pytest.raises(ConfigError, match="no gpu tier"):
            admin.evict_bytes(1, TierName.GPU)


def test_layout_mismatch_and_bad_input_are_the_store_errors(server: ServerProcess) -> None:
    other = KVLayout(model_id="other", num_layers=2, num_kv_heads=2, head_dim=16)
    with pytest.raises(LayoutMismatchError, match="start another server"):
        Client(server.url, other)
    with Client(server.url, SERVER_LAYOUT) as client:
        with pytest.raises(InvalidInputError, match="does not match layout"):
            client.store(make_tokens(10), make_kv(SERVER_LAYOUT, 9))
        with pytest.raises(InvalidInputError, match="token ids must lie"):
            client.lookup([-1, 2])


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_no_server_is_a_clear_error_fast(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(ServerUnavailableError, match="is `kvstore serve` running"):
        Client(f"tcp://127.0.0.1:{free_port()}", SERVER_LAYOUT, connect_timeout_s=0.5)
    assert time.monotonic() - started < 5


def test_a_client_survives_a_server_restart_and_sigterm_flushes(tmp_path: Path) -> None:
    port = str(free_port())
    tokens, kv = make_tokens(80, seed=61), make_kv(SERVER_LAYOUT, 80, seed=61)
    with running_server(tmp_path / "data", "--port", port) as first:
        client = Client(first.url, SERVER_LAYOUT, timeout_s=2)
        client.store(tokens, kv)  # not durable: SIGTERM must flush it
        stale = client.lookup(tokens)
        assert first.stop(signal.SIGTERM) == 0
    with pytest.raises(ServerUnavailableError):
        client.stats()
    with running_server(tmp_path / "data", "--port", port):
        with pytest.raises(ConfigError):
            client.retrieve(stale)  # plans do not survive a restart
        result = client.retrieve(client.lookup(tokens))  # the same client said hello again
        assert torch.equal(result.kv, kv), "SIGTERM flushed the pending disk writes"
        client.close()


_CRASHING_CLIENT = """
import sys, numpy as np, torch
from kvstore import Client
from tests.server.conftest import SERVER_LAYOUT
from tests.factories import make_kv, make_tokens
client = Client(sys.argv[1], SERVER_LAYOUT)
tokens = make_tokens(64, seed=71)
client.store(tokens, make_kv(SERVER_LAYOUT, 64, seed=71))
buffer = client.buffer(64)
session = client.session()
plans = [session.lookup(tokens) for _ in range(5)]
loose = client.lookup(tokens)
print("ready", flush=True)
sys.stdin.read()
"""


def test_a_client_killed_with_minus_9_leaks_no_pins_and_no_shared_memory(server: ServerProcess) -> None:
    with Client(server.url) as admin:
        before = admin.stats().num_open_plans
        with subprocess.Popen(
            [sys.executable, "-c", _CRASHING_CLIENT, server.url],
            cwd=REPO_ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        ) as crashing:
            assert crashing.stdout is not None and crashing.stdout.readline().strip() == "ready"
            assert admin.stats().num_open_plans == before + 6
            assert segments_mapped(server.pid, crashing.pid) >= 1, "the client's segments are shared"
            os.kill(crashing.pid, signal.SIGKILL)
            crashing.wait()
        assert wait_until(lambda: admin.stats().num_open_plans == before), "the janitor released the dead client"
        assert all(summary.pid != crashing.pid for summary in admin.info().clients)
        assert wait_until(lambda: segments_mapped(server.pid, crashing.pid) == 0), "its segments were unmapped"


def test_metrics_count_requests_latency_and_bytes(server: ServerProcess) -> None:
    tokens, kv = make_tokens(48, seed=81), make_kv(SERVER_LAYOUT, 48, seed=81)
    with Client(server.url, SERVER_LAYOUT) as client:
        client.store(tokens, kv)
        client.retrieve(client.lookup(tokens))
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"}
    assert values["kvstore_lookup_seconds_count"] >= 1
    assert values['kvstore_retrieve_seconds_count{transport="shm"}'] >= 1
    assert values['kvstore_bulk_bytes_total{direction="stored",transport="shm"}'] >= SERVER_LAYOUT.chunk_bytes(48)
    assert values['kvstore_lookup_tokens_total{kind="exact"}'] >= 48
    assert values['kvstore_tier_used_bytes{tier="cpu"}'] > 0
    assert values['kvstore_requests_total{op="lookup",outcome="ok"}'] >= 1
    assert "kvstore_blend_strikes_total" in values and "kvstore_lookup_coverage_ratio_count" in values
