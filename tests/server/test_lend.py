"""Lent retrieves against a real ``kvstore serve``: the server names where a plan's chunks lie in its shared cpu
arena, the client reads them through its own read-only mapping, and the plan stays pinned until it is returned
(by every reader, for a plan ranks share). A plan with a chunk outside the cpu tier is not lent and is retrieved as
before; a client that departs with a loan gives it back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstore import Client
from kvstore.errors import KVStoreError
from kvstore.kv_part import KVPart
from kvstore.tiers.base import TierName
from tests.factories import make_kv, make_tokens
from tests.server.conftest import CHUNK_SIZE, REPO_ROOT, SERVER_LAYOUT, ServerProcess, running_server

pytestmark = pytest.mark.slow

LAYERS, HEADS = SERVER_LAYOUT.num_layers, SERVER_LAYOUT.num_kv_heads


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory.mktemp("lend") / "data") as started:
        yield started


@pytest.fixture
def client(server: ServerProcess) -> Iterator[Client]:
    with Client(server.url, SERVER_LAYOUT) as connected:
        yield connected


def cpu_pins(client: Client) -> int:
    return next(tier.num_pinned for tier in client.stats().tiers if tier.tier is TierName.CPU)


def stored(client: Client, num_tokens: int, seed: int) -> tuple[list[int], torch.Tensor]:
    tokens = make_tokens(num_tokens, seed=seed)
    kv = make_kv(SERVER_LAYOUT, num_tokens, seed=seed)
    client.store(tokens, kv)
    client.flush()  # the disk's write-through pins its cpu slots until written: only a plan's pins remain
    return tokens, kv


def assembled(lent_pieces: tuple, start: int, end: int, like: torch.Tensor) -> torch.Tensor:
    """The lent pieces copied in token order into one tensor of ``[start, end)``."""
    out = torch.zeros_like(like[:, :, start:end])
    for piece in lent_pieces:
        out[:, :, piece.start - start : piece.end - start] = piece.kv
    return out


def test_the_hello_names_the_arena_and_a_lend_reads_what_a_retrieve_reads(client: Client) -> None:
    assert client.server.lent_arena is not None
    tokens, kv = stored(client, 5 * CHUNK_SIZE + 3, seed=1)
    for start in (0, CHUNK_SIZE, 2 * CHUNK_SIZE):
        unpinned = cpu_pins(client)
        plan = client.lookup(tokens)
        lent = client.lend(plan, start=start)
        assert lent is not None
        assert lent.num_prefix_tokens == len(tokens)
        assert lent.pieces[0].start == start and lent.pieces[-1].end == len(tokens)
        torch.testing.assert_close(assembled(lent.pieces, start, len(tokens), kv), kv[:, :, start:], rtol=0, atol=0)
        assert cpu_pins(client) > unpinned  # held while lent
        client.return_loan(plan)
        assert cpu_pins(client) == unpinned
        with pytest.raises(KVStoreError, match="not lent"):
            client.return_loan(plan)  # once


def test_the_client_maps_the_arena_read_only(client: Client) -> None:
    tokens, _ = stored(client, 2 * CHUNK_SIZE, seed=2)
    plan = client.lookup(tokens)
    assert client.lend(plan) is not None
    try:
        arena = client.server.lent_arena
        assert arena is not None
        with open("/proc/self/maps") as maps:
            mappings = [line.split() for line in maps if f"/memfd:{arena.name}" in line]
        assert mappings and all(fields[1] == "r--s" for fields in mappings)  # shared, and never writable here
    finally:
        client.return_loan(plan)


def test_a_part_is_its_heads_of_every_chunk_and_readers_share_the_pins(server: ServerProcess) -> None:
    with (
        Client(server.url, SERVER_LAYOUT) as scheduler,
        Client(server.url, SERVER_LAYOUT) as rank0,
        Client(server.url, SERVER_LAYOUT) as rank1,
    ):
        tokens, kv = stored(scheduler, 3 * CHUNK_SIZE, seed=3)
        unpinned = cpu_pins(scheduler)
        plan = scheduler.lookup(tokens)
        parts = [KVPart(layer_start=0, layer_end=LAYERS, head_start=h, head_end=h + 1) for h in range(HEADS)]
        owner = scheduler.client_token
        loans = [
            rank.lend(plan, owner=owner, part=part, readers=2) for rank, part in zip((rank0, rank1), parts, strict=True)
        ]
        for lent, part in zip(loans, parts, strict=True):
            assert lent is not None
            torch.testing.assert_close(assembled(lent.pieces, 0, len(tokens), part.of(kv)), part.of(kv), rtol=0, atol=0)
        rank0.return_loan(plan, owner=owner)
        assert cpu_pins(scheduler) > unpinned  # rank 1 still reads
        rank1.return_loan(plan, owner=owner)
        assert cpu_pins(scheduler) == unpinned


def test_a_plan_with_a_chunk_outside_the_cpu_tier_is_not_lent_and_still_retrieves(
    tmp_path: Path,
) -> None:
    # a cpu tier of two chunks: the third is stored on the disk only, and the plan's pins on the other two leave
    # its prefetch no slot
    with running_server(tmp_path / "data", "--cpu-size", "8KiB") as small, Client(small.url, SERVER_LAYOUT) as client:
        tokens, kv = stored(client, 3 * CHUNK_SIZE, seed=4)
        client.flush()
        plan = client.lookup(tokens)
        assert [segment.tier for segment in plan.segments] == [TierName.CPU, TierName.CPU, TierName.DISK]
        assert client.lend(plan) is None
        result = client.retrieve(plan)  # the plan is as it was
        torch.testing.assert_close(result.kv, kv, rtol=0, atol=0)


def test_a_client_that_dies_with_a_loan_gives_it_back(server: ServerProcess, client: Client) -> None:
    tokens, _ = stored(client, 2 * CHUNK_SIZE, seed=5)
    script = "\n".join(
        [
            "import os, signal",
            "from kvstore import Client",
            "from kvstore.layout import KVLayout",
            f"client = Client({server.url!r}, KVLayout.from_json({SERVER_LAYOUT.to_json()!r}))",
            f"plan = client.lookup({[int(token) for token in tokens]!r})",
            "assert client.lend(plan) is not None",
            "print('lent', flush=True)",
            "os.kill(os.getpid(), signal.SIGKILL)",
        ]
    )
    child = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    assert "lent" in child.stdout, child.stderr
    assert child.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 20
    while cpu_pins(client) and time.monotonic() < deadline:  # the janitor notices the dead pid within a second
        time.sleep(0.2)
    assert cpu_pins(client) == 0
    assert os.path.exists(f"/proc/{server.pid}")
