"""Chunks stored and retrieved by parts against a real ``kvstore serve``: the ranks of a tensor- or pipeline-parallel
engine each send their layers x KV heads of a chunk, the server commits the chunk whole once every part has arrived
(one copy, the same keys as a single-rank engine's), a chunk missing a part is a miss named ``incomplete``, parts that
never complete expire, and a plan handed to several ranks stays pinned until each has retrieved or released its
part."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore import Client, InvalidInputError
from kvstore.kv_part import KVPart
from kvstore.misses import MissReason
from kvstore.tiers.base import TierName
from tests.factories import make_kv, make_tokens
from tests.server.conftest import CHUNK_SIZE, SERVER_LAYOUT, ServerProcess, running_server

pytestmark = pytest.mark.slow

LAYERS, HEADS = SERVER_LAYOUT.num_layers, SERVER_LAYOUT.num_kv_heads
TP2 = (
    KVPart(layer_start=0, layer_end=LAYERS, head_start=0, head_end=1),
    KVPart(layer_start=0, layer_end=LAYERS, head_start=1, head_end=HEADS),
)
PP2 = (
    KVPart(layer_start=0, layer_end=1, head_start=0, head_end=HEADS),
    KVPart(layer_start=1, layer_end=LAYERS, head_start=0, head_end=HEADS),
)
TP2_PP2 = tuple(
    KVPart(layer_start=layer, layer_end=layer + 1, head_start=head, head_end=head + 1)
    for layer in range(LAYERS)
    for head in range(HEADS)
)
SHAPES = {"tp2": TP2, "pp2": PP2, "tp2_pp2": TP2_PP2}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory.mktemp("parts") / "data") as started:
        yield started


def scrape(server: ServerProcess) -> dict[str, float]:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"}


def parts_counted(server: ServerProcess, outcome: str) -> float:
    return scrape(server).get(f'kvstore_chunk_parts_total{{outcome="{outcome}"}}', 0.0)


def memory_chunks(client: Client) -> int:
    tier = client.stats().tier(TierName.CPU)
    assert tier is not None
    return tier.num_chunks


@pytest.mark.parametrize("shape", SHAPES)
def test_the_ranks_parts_make_one_whole_chunk_only_once_all_have_arrived(server: ServerProcess, shape: str) -> None:
    parts = SHAPES[shape]
    num_tokens = 3 * CHUNK_SIZE + 5
    seed = list(SHAPES).index(shape)
    tokens, kv = make_tokens(num_tokens, seed=seed), make_kv(SERVER_LAYOUT, num_tokens, seed=seed)
    completed_before = parts_counted(server, "completed")
    with Client(server.url, SERVER_LAYOUT) as client:
        chunks_before = memory_chunks(client)
        for index, part in enumerate(parts[:-1]):
            transport_kv = part.of(kv) if index % 2 else part.of(kv).contiguous()  # a strided view is copied
            result = client.store(tokens, transport_kv, part=part)
            assert (result.num_chunks, result.num_new_chunks) == (4, 0), "nothing is stored before every part"
            plan = client.lookup(tokens, pin=False)
            assert plan.num_prefix_tokens == 0
            assert {miss.reason for miss in plan.misses} == {MissReason.INCOMPLETE}, "a missing part is named"
        last = client.store(tokens, parts[-1].of(kv).contiguous(), part=parts[-1])
        assert (last.num_chunks, last.num_new_chunks) == (4, 4)
        assert memory_chunks(client) - chunks_before == 4, "one copy of the tokens, not one per rank"
        plan = client.lookup(tokens)
        assert plan.num_prefix_tokens == num_tokens
        assert torch.equal(client.retrieve(plan).kv, kv), "a single-rank engine reads what the ranks stored"
    assert parts_counted(server, "completed") - completed_before == 4


@pytest.mark.parametrize("shape", SHAPES)
def test_each_rank_retrieves_its_part_of_one_pinned_plan(server: ServerProcess, shape: str) -> None:
    parts = SHAPES[shape]
    num_tokens, start = 4 * CHUNK_SIZE, CHUNK_SIZE
    seed = 50 + list(SHAPES).index(shape)
    tokens, kv = make_tokens(num_tokens, seed=seed), make_kv(SERVER_LAYOUT, num_tokens, seed=seed)
    with Client(server.url, SERVER_LAYOUT, name="scheduler") as scheduler:
        scheduler.store(tokens, kv)  # stored whole, by a single-rank engine
        plan = scheduler.lookup(tokens)
        owner = scheduler.client_token
        for index, part in enumerate(parts):
            with Client(server.url, SERVER_LAYOUT, name=f"rank {index}") as rank:
                out = rank.buffer(num_tokens - start, part=part)
                result = rank.retrieve(plan, out, owner=owner, start=start, part=part, readers=len(parts))
                assert result.num_cached_tokens == num_tokens - start
                assert torch.equal(result.kv, part.of(kv)[:, :, start:]), f"{part.describe()}"
                open_plans = scheduler.stats().num_open_plans
                assert open_plans == (0 if index == len(parts) - 1 else 1), "pinned until every part is done"
                if index == len(parts) - 1:
                    with pytest.raises(Exception, match="already retrieved or released"):
                        rank.retrieve(plan, owner=owner, start=start, part=part, readers=len(parts))


def test_a_rank_that_loads_nothing_releases_its_share_and_the_plan_closes(server: ServerProcess) -> None:
    tokens, kv = make_tokens(2 * CHUNK_SIZE, seed=61), make_kv(SERVER_LAYOUT, 2 * CHUNK_SIZE, seed=61)
    with Client(server.url, SERVER_LAYOUT) as scheduler, Client(server.url, SERVER_LAYOUT) as rank:
        scheduler.store(tokens, kv)
        plan = scheduler.lookup(tokens)
        first = rank.retrieve(plan, owner=scheduler.client_token, part=TP2[0], readers=2)
        assert torch.equal(first.kv, TP2[0].of(kv))
        assert scheduler.stats().num_open_plans == 1
        rank.release(plan, owner=scheduler.client_token, readers=2)
        assert scheduler.stats().num_open_plans == 0


def test_ranks_holding_the_same_part_each_retrieve_it_from_one_plan(server: ServerProcess) -> None:
    """KV heads replicated over more ranks than there are heads, or an MLA latent every rank loads whole."""
    tokens, kv = make_tokens(2 * CHUNK_SIZE, seed=63), make_kv(SERVER_LAYOUT, 2 * CHUNK_SIZE, seed=63)
    with Client(server.url, SERVER_LAYOUT) as scheduler:
        scheduler.store(tokens, kv)
        plan = scheduler.lookup(tokens)
        for reader, part in enumerate((TP2[0], TP2[0], None)):
            with Client(server.url, SERVER_LAYOUT) as rank:
                result = rank.retrieve(plan, owner=scheduler.client_token, part=part, readers=3)
                assert torch.equal(result.kv, kv if part is None else part.of(kv))
                assert scheduler.stats().num_open_plans == (0 if reader == 2 else 1)


def test_a_part_of_a_chunk_only_the_disk_holds_is_decoded_and_sliced(server: ServerProcess) -> None:
    num_tokens = 2 * CHUNK_SIZE
    tokens, kv = make_tokens(num_tokens, seed=71), make_kv(SERVER_LAYOUT, num_tokens, seed=71)
    with Client(server.url, SERVER_LAYOUT) as client:
        client.store(tokens, kv, durable=True)
        client.evict_bytes(1 << 30, "cpu")
        plan = client.lookup(tokens)
        assert {segment.tier for segment in plan.segments} == {TierName.DISK}
        result = client.retrieve(plan, start=CHUNK_SIZE // 2, part=PP2[1])
        assert torch.equal(result.kv, PP2[1].of(kv)[:, :, CHUNK_SIZE // 2 :])


def test_an_assembly_a_rank_never_completes_expires_and_is_counted(tmp_path: Path) -> None:
    tokens, kv = make_tokens(2 * CHUNK_SIZE, seed=81), make_kv(SERVER_LAYOUT, 2 * CHUNK_SIZE, seed=81)
    with (
        running_server(tmp_path / "data", "--plan-ttl-s", "1") as server,  # assemblies expire after a second
        Client(server.url, SERVER_LAYOUT) as client,
    ):
        expired_before = parts_counted(server, "expired")
        client.store(tokens, TP2[0].of(kv).contiguous(), part=TP2[0])
        deadline = time.monotonic() + 30
        while parts_counted(server, "expired") - expired_before < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert parts_counted(server, "expired") - expired_before == 2
        client.store(tokens, TP2[1].of(kv).contiguous(), part=TP2[1])  # the other rank, too late
        plan = client.lookup(tokens, pin=False)
        assert plan.num_prefix_tokens == 0, "a chunk missing a part is never stored half"


def test_a_part_outside_the_layout_is_refused_in_one_line(server: ServerProcess) -> None:
    tokens, kv = make_tokens(CHUNK_SIZE, seed=91), make_kv(SERVER_LAYOUT, CHUNK_SIZE, seed=91)
    outside = KVPart(layer_start=0, layer_end=LAYERS + 1, head_start=0, head_end=1)
    with Client(server.url, SERVER_LAYOUT) as client:
        with pytest.raises(InvalidInputError, match="lies outside layout"):
            client.store(tokens, kv, part=outside)
        with pytest.raises(InvalidInputError, match="empty or negative"):
            KVPart(layer_start=1, layer_end=1, head_start=0, head_end=1)


def test_tokens_stored_by_parts_extend_a_prefix_stored_whole(server: ServerProcess) -> None:
    num_tokens, start = 3 * CHUNK_SIZE, CHUNK_SIZE
    tokens, kv = make_tokens(num_tokens, seed=101), make_kv(SERVER_LAYOUT, num_tokens, seed=101)
    with Client(server.url, SERVER_LAYOUT) as client:
        client.store(tokens[:start], kv[:, :, :start])
        for part in TP2:
            client.store(tokens, part.of(kv)[:, :, start:].contiguous(), start=start, part=part)
        plan = client.lookup(np.concatenate([tokens, [1, 2, 3]]))
        assert plan.num_prefix_tokens == num_tokens
        assert torch.equal(client.retrieve(plan).kv, kv)
