"""``Client.store(tokens, kv, start=...)`` against a real ``kvstore serve``: only the tail's KV travels (shared
memory and inline), the server stores what a whole store would, and a bad ``start`` is an error reply."""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore import Client, InvalidInputError
from kvstore.keys import as_token_array
from kvstore.wire.connection import Connection
from kvstore.wire.error_codes import ErrorCode
from kvstore.wire.messages import HelloArgs, InlineBulk, StoreArgs
from kvstore.wire.protocol import Op
from kvstore.wire.shm import host_id
from tests.factories import make_kv, make_tokens
from tests.server.conftest import CHUNK_SIZE, SERVER_LAYOUT, ServerProcess, running_server

pytestmark = pytest.mark.slow


def scrape(server: ServerProcess) -> dict[str, float]:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"}


def stored_bytes(server: ServerProcess, transport: str) -> float:
    return scrape(server).get(f'kvstore_bulk_bytes_total{{direction="stored",transport="{transport}"}}', 0.0)


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_the_tail_after_the_head_serves_the_whole_sequence(server: ServerProcess, transport: str) -> None:
    num_tokens, start = 5 * CHUNK_SIZE + 7, 2 * CHUNK_SIZE
    tokens, kv = make_tokens(num_tokens, seed=31 + len(transport)), make_kv(SERVER_LAYOUT, num_tokens, seed=31)
    with Client(server.url, SERVER_LAYOUT, transport=transport) as client:
        head = client.store(tokens[:start], kv[:, :, :start])
        assert (head.num_chunks, head.num_new_chunks) == (2, 2)
        before = stored_bytes(server, transport)
        tail = client.store(tokens, kv[:, :, start:].clone(), start=start)
        assert (tail.num_chunks, tail.num_new_chunks) == (4, 4)
        assert stored_bytes(server, transport) - before == SERVER_LAYOUT.chunk_bytes(num_tokens - start), (
            "only the tail's KV crosses the transport"
        )
        assert client.store(tokens, kv[:, :, start:], start=start).num_new_chunks == 0
        plan = client.lookup(np.concatenate([tokens, [7, 8]]))
        assert plan.num_prefix_tokens == num_tokens and all(segment.exact for segment in plan.segments)
        assert torch.equal(client.retrieve(plan).kv, kv)


def test_a_tail_computed_into_a_shared_buffer_is_stored_from_it(server: ServerProcess) -> None:
    num_tokens, start = 4 * CHUNK_SIZE, CHUNK_SIZE
    tokens, kv = make_tokens(num_tokens, seed=41), make_kv(SERVER_LAYOUT, num_tokens, seed=41)
    with Client(server.url, SERVER_LAYOUT, transport="shm") as client:
        client.store(tokens[:start], kv[:, :, :start])
        buffer = client.buffer(num_tokens - start)
        buffer.copy_(kv[:, :, start:])
        assert client.store(tokens, buffer, start=start).num_new_chunks == 3
        assert torch.equal(client.retrieve(client.lookup(tokens)).kv, kv)


def test_a_start_past_the_tokens_or_with_kv_of_another_length_is_refused(server: ServerProcess) -> None:
    tokens, kv = make_tokens(3 * CHUNK_SIZE, seed=51), make_kv(SERVER_LAYOUT, 3 * CHUNK_SIZE, seed=51)
    with Client(server.url, SERVER_LAYOUT) as client:
        with pytest.raises(InvalidInputError, match=rf"start={4 * CHUNK_SIZE} must lie in \[0, len\(tokens\)="):
            client.store(tokens, kv[:, :, :0], start=4 * CHUNK_SIZE)
        with pytest.raises(InvalidInputError, match="does not match layout"):
            client.store(tokens, kv, start=CHUNK_SIZE)  # the whole sequence's KV with a start
        assert client.stats().num_open_plans == 0 and client.lookup(tokens).segments == ()
        stored = client.store(tokens, kv[:, :, CHUNK_SIZE + 1 :], start=CHUNK_SIZE + 1)  # inside chunk 1
        assert (stored.num_chunks, stored.num_new_chunks) == (1, 1)
        plan = client.lookup(tokens)
        assert [segment.start for segment in plan.segments] in ([], [2 * CHUNK_SIZE])  # chunks 0 and 1: not sent
        client.release(plan)


def test_malformed_starts_on_the_wire_get_error_replies(server: ServerProcess) -> None:
    """Past the client's checks: out of range, negative, not an int. The server answers each
    with ``invalid_argument`` and goes on serving; a store without the field (an older client) starts at 0."""
    tokens = as_token_array(make_tokens(2 * CHUNK_SIZE, seed=61))
    connection = Connection(server.url)
    try:
        hello = HelloArgs(layout_json=SERVER_LAYOUT.to_json(), client_name="wire", pid=os.getpid(), host_id=host_id())
        reply = connection.request(Op.HELLO, None, hello.to_wire(), None, 10)
        assert reply.ok and reply.result is not None
        client_id = reply.result.required_str("client_id", 64)
        older = StoreArgs(tokens=tokens, bulk=InlineBulk(), durable=False).to_wire()
        assert "start" not in older, "start=0 is not sent: a server from before the field takes the store"
        tail_bytes = memoryview(make_kv(SERVER_LAYOUT, CHUNK_SIZE, seed=61).view(torch.uint8).numpy().tobytes())
        for start, message in [
            (2 * CHUNK_SIZE + 1, "'start'=33 is out of range [0, 32]"),
            (-CHUNK_SIZE, "'start'=-16 is out of range [0, 32]"),
            ("16", "field 'start' must be an int, got str"),
        ]:
            reply = connection.request(Op.STORE, client_id, {**older, "start": start}, tail_bytes, 10)
            assert not reply.ok and reply.error_code == ErrorCode.INVALID_ARGUMENT, reply.error_message
            assert message in reply.error_message
        reply = connection.request(Op.STORE, client_id, {**older, "start": CHUNK_SIZE}, tail_bytes, 10)
        assert reply.ok and reply.result is not None and reply.result.required_int("num_new_chunks", 0, 9) == 1
        whole = memoryview(make_kv(SERVER_LAYOUT, 2 * CHUNK_SIZE, seed=61).view(torch.uint8).numpy().tobytes())
        reply = connection.request(Op.STORE, client_id, older, whole, 10)
        assert reply.ok and reply.result is not None and reply.result.required_int("num_new_chunks", 0, 9) == 1
        connection.request(Op.GOODBYE, client_id, {}, None, 10)
    finally:
        connection.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the shm and inline twins run everywhere)")
def test_a_cuda_tail_travels_by_ipc_handle(tmp_path: Path) -> None:
    num_tokens, start = 6 * CHUNK_SIZE + 3, 3 * CHUNK_SIZE
    tokens, kv = make_tokens(num_tokens, seed=71), make_kv(SERVER_LAYOUT, num_tokens, seed=71).cuda()
    with running_server(tmp_path / "data", "--tiers", "gpu,cpu,disk", "--gpu-size", "50MiB") as gpu_server:
        with Client(gpu_server.url, SERVER_LAYOUT) as client:
            assert client.server.features.cuda_ipc
            client.store(tokens[:start], kv[:, :, :start])
            tail = client.store(tokens, kv[:, :, start:], start=start)  # a view: the handle carries its offset
            assert (tail.num_chunks, tail.num_new_chunks) == (4, 4)
            assert torch.equal(client.retrieve(client.lookup(tokens)).kv, kv.cpu())
        assert stored_bytes(gpu_server, "cuda_ipc") == SERVER_LAYOUT.chunk_bytes(num_tokens)
