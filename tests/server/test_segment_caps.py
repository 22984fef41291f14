"""Caps on the shared-memory segments the server maps: per client, per process (whatever number of client ids it
registers) and in all. Every segment is a mapping of the server's, and a process near Linux's 65,530 mappings can
no longer map LMDB pages or start a thread; a process that registered 1,025 ids once held 64,917 segments."""

from __future__ import annotations

import fcntl
import os
import secrets
import subprocess
import sys
import textwrap
import urllib.request

import pytest
import torch

from kvstore import Client
from kvstore.server.clients import MAX_SEGMENTS_PER_CLIENT, MAX_SEGMENTS_PER_PROCESS, ClientRegistry
from kvstore.wire.error_codes import ErrorCode, RequestError
from tests.factories import make_kv, make_tokens
from tests.server.conftest import CHUNK_SIZE, REPO_ROOT, SERVER_LAYOUT, ServerProcess
from tests.server.test_hostile_clients import RawClient, _memfd

pytestmark = pytest.mark.slow


def _fill(registry: ClientRegistry, client_id: str, count: int) -> None:
    for _ in range(count):
        registry.add_segment(client_id, torch.empty(64, dtype=torch.uint8))


def _refusal(registry: ClientRegistry, client_id: str) -> RequestError:
    with pytest.raises(RequestError) as raised:
        registry.add_segment(client_id, torch.empty(64, dtype=torch.uint8))
    assert raised.value.code is ErrorCode.CAPACITY
    return raised.value


def test_a_process_is_capped_over_all_its_client_ids_and_others_keep_attaching() -> None:
    registry = ClientRegistry(max_segments_per_process=100, max_segments_total=1000)
    hostile = [registry.register(f"hostile {index}", pid=4242, local=True, has_layout=True) for index in range(3)]
    _fill(registry, hostile[0], MAX_SEGMENTS_PER_CLIENT)
    assert "at most 64 segments" in str(_refusal(registry, hostile[0]))
    _fill(registry, hostile[1], 100 - MAX_SEGMENTS_PER_CLIENT)
    assert "the clients of process 4242 hold 100 segments" in str(_refusal(registry, hostile[2]))
    honest = registry.register("honest", pid=777, local=True, has_layout=True)
    _fill(registry, honest, 10)


def test_the_server_caps_segments_in_all() -> None:
    registry = ClientRegistry(max_segments_per_process=50, max_segments_total=120)
    for pid in range(3):
        client_id = registry.register(f"client {pid}", pid=1000 + pid, local=True, has_layout=True)
        _fill(registry, client_id, min(40, 120 - 40 * pid))
    late = registry.register("late", pid=2000, local=True, has_layout=True)
    assert "the server maps 120 segments" in str(_refusal(registry, late))
    assert "\n" not in str(_refusal(registry, late))


HONEST_CLIENT = textwrap.dedent(
    """
    import sys, torch
    from kvstore import Client
    from tests.factories import make_kv, make_tokens
    from tests.server.conftest import CHUNK_SIZE, SERVER_LAYOUT
    tokens, kv = make_tokens(4 * CHUNK_SIZE, seed=77), make_kv(SERVER_LAYOUT, 4 * CHUNK_SIZE, seed=77)
    with Client(sys.argv[1], SERVER_LAYOUT) as client:
        client.store(tokens, kv)
        buffer = client.buffer(4 * CHUNK_SIZE)  # a segment of its own: another process is not capped by the hostile
        result = client.retrieve(client.lookup(tokens), buffer)
        assert result.kv.data_ptr() == buffer.data_ptr() and torch.equal(result.kv, kv)
    print("ok")
    """
)


def test_one_process_with_many_client_ids_cannot_exhaust_the_servers_mappings(server: ServerProcess) -> None:
    hostile = [RawClient(server.url) for _ in range(MAX_SEGMENTS_PER_PROCESS // MAX_SEGMENTS_PER_CLIENT + 1)]
    descriptors: list[int] = []
    refusals = []
    try:
        for raw in hostile:
            for _ in range(MAX_SEGMENTS_PER_CLIENT):
                name = f"kvstore-{os.getpid()}-{secrets.token_hex(8)}"
                descriptors.append(_memfd(name, 4096, seals=fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW))
                reply = raw.attach(name, 4096, descriptors[-1])
                if not reply.ok:
                    refusals.append(reply)
        assert len(refusals) == MAX_SEGMENTS_PER_CLIENT, "the whole last id's worth is refused, nothing before"
        assert {reply.error_code for reply in refusals} == {"capacity"}
        assert all("\n" not in (reply.error_message or "") for reply in refusals)

        honest = subprocess.run(
            [sys.executable, "-c", HONEST_CLIENT, server.url], cwd=REPO_ROOT, capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        assert honest.returncode == 0 and honest.stdout.strip() == "ok", honest.stderr[-2000:]

        tokens, kv = make_tokens(3 * CHUNK_SIZE, seed=78), make_kv(SERVER_LAYOUT, 3 * CHUNK_SIZE, seed=78)
        with Client(server.url, SERVER_LAYOUT) as same_process:  # its scratch is refused: it goes inline
            same_process.store(tokens, kv)
            assert torch.equal(same_process.retrieve(same_process.lookup(tokens)).kv, kv)
        health = server.metrics_url.replace("/metrics", "/healthz")
        with urllib.request.urlopen(health, timeout=10) as response:
            assert response.status == 200
    finally:
        for raw in hostile:
            raw.close()
        for fd in descriptors:
            os.close(fd)
    assert server.process.poll() is None and "Traceback" not in server.stderr()
