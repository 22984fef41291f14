"""``ChunkAssembly`` on its own: a chunk is handed back only once every (layer, head) cell has arrived, whole and
exact; a chunk the store holds takes no part; the oldest incomplete chunks are dropped for room; old ones expire."""

from __future__ import annotations

import torch

from kvstore.keys import PrefixKey, as_token_array, chunk_bounds, keys_at_bounds
from kvstore.kv_part import KVPart
from kvstore.server.chunk_assembly import ChunkAssembly, CompletedChunk
from tests.factories import make_kv, make_tokens
from tests.server.conftest import SERVER_LAYOUT

LAYOUT = SERVER_LAYOUT
CHUNK = 16
HALVES = (
    KVPart(layer_start=0, layer_end=LAYOUT.num_layers, head_start=0, head_end=1),
    KVPart(layer_start=0, layer_end=LAYOUT.num_layers, head_start=1, head_end=LAYOUT.num_kv_heads),
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def call_of(num_tokens: int, seed: int) -> tuple[list[PrefixKey], list[int], torch.Tensor]:
    tokens = as_token_array(make_tokens(num_tokens, seed=seed))
    bounds = chunk_bounds(tokens, CHUNK)
    return keys_at_bounds(LAYOUT.namespace, tokens, bounds), bounds, make_kv(LAYOUT, num_tokens, seed=seed)


def test_a_chunk_comes_back_whole_and_exact_only_with_its_last_part() -> None:
    keys, bounds, kv = call_of(2 * CHUNK + 3, seed=1)
    assembly = ChunkAssembly(LAYOUT)

    def add(part: KVPart, part_kv: torch.Tensor) -> list[int]:
        done = assembly.add(part, part_kv, keys=keys, bounds=bounds, first=0, start=0, held=lambda key: False)
        completed.extend(done)
        return [chunk.index for chunk in done]

    completed: list[CompletedChunk] = []
    assert add(HALVES[1], HALVES[1].of(kv)) == []
    assert assembly.counts().pending == 3 and all(assembly.pending(key) for key in keys)
    assert add(HALVES[0], HALVES[0].of(kv).contiguous()) == [0, 1, 2]
    done = completed
    assert torch.equal(torch.cat([chunk.kv for chunk in done], dim=2), kv)
    counts = assembly.counts()
    assert (counts.parts, counts.completed, counts.pending, counts.pending_bytes) == (6, 3, 0, 0)


def test_a_chunk_the_store_holds_takes_no_part_and_drops_its_assembly() -> None:
    keys, bounds, kv = call_of(2 * CHUNK, seed=2)
    assembly = ChunkAssembly(LAYOUT)
    assembly.add(HALVES[0], HALVES[0].of(kv), keys=keys, bounds=bounds, first=0, start=0, held=lambda key: False)
    done = assembly.add(
        HALVES[1], HALVES[1].of(kv), keys=keys, bounds=bounds, first=0, start=0, held=lambda key: key == keys[0]
    )
    assert [chunk.index for chunk in done] == [1]
    assert assembly.num_pending == 0, "the held chunk's half-made assembly is gone"


def test_a_call_from_start_fills_only_the_chunks_it_writes() -> None:
    keys, bounds, kv = call_of(3 * CHUNK, seed=3)
    assembly = ChunkAssembly(LAYOUT)
    for half in HALVES:
        done = assembly.add(
            half, half.of(kv)[:, :, CHUNK:], keys=keys, bounds=bounds, first=1, start=CHUNK, held=lambda key: False
        )
    assert [chunk.index for chunk in done] == [1, 2]
    assert torch.equal(done[0].kv, kv[:, :, CHUNK : 2 * CHUNK])


def test_the_oldest_incomplete_chunks_go_for_room_and_old_ones_expire() -> None:
    clock = Clock()
    assembly = ChunkAssembly(LAYOUT, max_bytes=2 * LAYOUT.chunk_bytes(CHUNK), clock=clock)
    first_keys, bounds, kv = call_of(2 * CHUNK, seed=4)
    assembly.add(HALVES[0], HALVES[0].of(kv), keys=first_keys, bounds=bounds, first=0, start=0, held=lambda k: False)
    clock.now = 10.0
    later_keys, bounds, kv = call_of(CHUNK, seed=5)
    assembly.add(HALVES[0], HALVES[0].of(kv), keys=later_keys, bounds=bounds, first=0, start=0, held=lambda k: False)
    assert assembly.counts().dropped == 1 and not assembly.pending(first_keys[0]) and assembly.pending(later_keys[0])
    assert assembly.expire(5.0) == 1, "the chunk started at 0 s is over 5 s old at 10 s"
    assert assembly.pending(later_keys[0]) and assembly.counts().expired == 1
    clock.now = 20.0
    assert assembly.expire(5.0) == 1 and assembly.num_pending == 0
