"""``LoadBuffers`` against a real ``kvstore serve``: loads reuse shared-memory buffers and get the right KV."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstore import Client, ServerUnavailableError
from kvstore.connectors.load_buffers import LoadBuffers
from tests.factories import make_kv, make_tokens
from tests.server.conftest import SERVER_LAYOUT, ServerProcess, running_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory.mktemp("buffers") / "data") as started:
        yield started


@pytest.fixture
def client(server: ServerProcess) -> Iterator[Client]:
    with Client(server.url, SERVER_LAYOUT) as opened:
        yield opened


def storage(buffer: torch.Tensor | None) -> int:
    assert buffer is not None
    return buffer.untyped_storage().data_ptr()


def test_a_buffer_given_back_serves_the_next_load_of_its_size_or_less(client: Client) -> None:
    buffers = LoadBuffers()
    first = buffers.take(client, 64)
    assert first is not None and first.shape == SERVER_LAYOUT.chunk_shape(64)
    buffers.give_back(first)

    again = buffers.take(client, 48)  # smaller: the kept 64-token buffer
    assert storage(again) == storage(first) and again is not None and again.shape[2] == 64
    concurrent = buffers.take(client, 32)  # the first is in use: a second buffer
    assert storage(concurrent) != storage(first)
    buffers.give_back(again)
    buffers.give_back(concurrent)
    assert buffers.num_kept == 2

    larger = buffers.take(client, 96)  # both kept ones are too small: released, a new one made
    assert storage(larger) not in (storage(first), storage(concurrent))
    assert buffers.num_kept == 1
    buffers.give_back(larger)
    buffers.give_back(torch.zeros(4))  # not one of its buffers: ignored
    buffers.give_back(None)
    assert buffers.num_kept == 1


def test_loads_through_one_reused_buffer_each_get_their_own_kv(client: Client) -> None:
    buffers = LoadBuffers()
    prompts = [(make_tokens(64, seed=seed), make_kv(SERVER_LAYOUT, 64, seed=seed)) for seed in (11, 12)]
    for tokens, kv in prompts:
        client.store(tokens, kv)
    used = set()
    for tokens, kv in prompts + prompts[:1]:
        plan = client.lookup(tokens)
        buffer = buffers.take(client, plan.end)
        result = client.retrieve(plan, buffer)
        assert torch.equal(result.kv[:, :, :64], kv)
        used.add(storage(buffer))
        buffers.give_back(buffer)
    assert len(used) == 1, "every load went through the same shared memory"


def test_a_buffer_of_a_client_that_is_gone_is_not_handed_to_another(server: ServerProcess, tmp_path: Path) -> None:
    buffers = LoadBuffers()
    with Client(server.url, SERVER_LAYOUT) as old:
        buffers.give_back(kept := buffers.take(old, 32))
    with Client(server.url, SERVER_LAYOUT) as new:
        fresh = buffers.take(new, 32)
        assert storage(fresh) != storage(kept), "the old connection's segment is not mapped for the new one"
        assert buffers.num_kept == 1
        tokens, kv = make_tokens(32, seed=13), make_kv(SERVER_LAYOUT, 32, seed=13)
        new.store(tokens, kv)
        assert torch.equal(new.retrieve(new.lookup(tokens), fresh).kv[:, :, :32], kv)


def test_taking_without_creating_never_asks_the_server(tmp_path: Path) -> None:
    """The engine thread stages saves with ``create=False``: a kept buffer or nothing, even with the server hung
    (SIGSTOP) -- and a buffer asked of a hung server is an error for the caller's link, not a silent ``None``."""
    with running_server(tmp_path / "data") as hung, Client(hung.url, SERVER_LAYOUT, timeout_s=1.0) as client:
        buffers = LoadBuffers()
        kept = buffers.take(client, 32)
        buffers.give_back(kept)
        hung.process.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            assert storage(buffers.take(client, 16, create=False)) == storage(kept)
            assert buffers.take(client, 64, create=False) is None, "none fits: nothing is created"
            assert time.monotonic() - started < 0.1
            with pytest.raises(ServerUnavailableError):
                buffers.take(client, 64)
        finally:
            hung.process.send_signal(signal.SIGCONT)


def test_a_server_on_another_host_gets_no_buffer(server: ServerProcess) -> None:
    with Client(server.url, SERVER_LAYOUT, transport="inline") as inline:
        assert not inline.shares_memory and LoadBuffers().take(inline, 16) is None


def test_save_staging_is_exactly_its_size_in_one_kept_buffer(client: Client) -> None:
    """A save stages in exactly its tokens: a 400-token buffer kept from a first save, handed whole to a 16-token
    save, crashed vLLM's step ("400 tokens do not fit in 1 blocks of 128 slots", issue 27's engine test). A kept
    buffer with room is handed out as a contiguous view of exactly those tokens over its first bytes, so one buffer
    serves every shorter save (no new segment, no first touch) and the server still finds its region."""
    buffers = LoadBuffers()
    buffers.give_back(buffers.take(client, 64, exact=True))
    small = buffers.take(client, 16, create=False, exact=True)
    assert small is not None and small.shape == SERVER_LAYOUT.chunk_shape(16) and small.is_contiguous()
    buffers.give_back(small)
    assert buffers.num_kept == 1, "the 64-token buffer served the 16-token save"
    again = buffers.take(client, 16, create=False, exact=True)
    assert storage(again) == storage(small)
    tokens, kv = make_tokens(16, seed=21), make_kv(SERVER_LAYOUT, 16, seed=21)
    assert again is not None
    again.copy_(kv)
    client.store(tokens, again)
    assert torch.equal(client.retrieve(client.lookup(tokens)).kv, kv)
