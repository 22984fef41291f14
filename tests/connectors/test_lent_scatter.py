"""A lent load's pieces (one strided view per chunk of one arena, chunk edges anywhere) land in the blocks exactly as
the same KV retrieved into one buffer and scattered whole, in vLLM's CPU format (K transposed), the packed CUDA
format and a format with neither dims nor slots adjacent (each a loop order of the kernel's); pieces that leave a gap
are refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.connectors.block_format import BlockFormat, PlaneMap
from kvstore.connectors.lent_scatter import compile_lent_scatter, scatter_lent
from kvstore.connectors.paged import PagedChunk, PagedLayer, PagedLayers
from kvstore.errors import InvalidInputError
from kvstore.wire.lent_kv import LentPiece
from tests.connectors.test_paged import packed_cache, probe, write_cpu_transposed, write_packed

SLOTS, DIM, ALL_HEADS, LAYERS, NUM_BLOCKS = 4, 8, 4, 2, 12


def engine_layers(kind: str, heads: int) -> PagedLayers:
    if kind == "cpu":
        caches = [torch.zeros(NUM_BLOCKS, heads, SLOTS, 2 * DIM) for _ in range(LAYERS)]
        block_format = probe(caches[0], DIM, write_cpu_transposed)
    elif kind == "dims-outer":  # neither dims nor slots adjacent: the kernel's general loop
        caches = [torch.zeros(NUM_BLOCKS, 2 * DIM * SLOTS * heads) for _ in range(LAYERS)]
        plane = PlaneMap(offset=0, token_stride=heads, head_stride=1, dim_stride=SLOTS * heads)
        value = PlaneMap(offset=DIM * SLOTS * heads, token_stride=heads, head_stride=1, dim_stride=SLOTS * heads)
        block_format = BlockFormat(block_size=SLOTS, num_kv_heads=heads, head_dim=DIM, key=plane, value=value)
    else:
        caches = [packed_cache(NUM_BLOCKS, heads, SLOTS, DIM, torch.float32, tokens_outer=True) for _ in range(LAYERS)]
        block_format = probe(caches[0], DIM, write_packed)
    return PagedLayers([PagedLayer(cache, block_format) for cache in caches])


@pytest.mark.parametrize("kind", ["cpu", "cuda-format", "dims-outer"])
@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    chunk_lengths=st.lists(st.integers(1, 11), min_size=1, max_size=6),
    head_range=st.sampled_from([(0, 4), (0, 2), (2, 4), (1, 2)]),
)
def test_pieces_land_where_one_buffer_would(kind: str, data: st.DataObject, chunk_lengths, head_range) -> None:
    total = sum(chunk_lengths)
    start = data.draw(st.integers(0, total // SLOTS)) * SLOTS  # the engine's own prefix: whole blocks
    end = data.draw(st.integers(start // SLOTS, total // SLOTS)) * SLOTS
    heads = head_range[1] - head_range[0]
    whole = torch.randn(LAYERS, 2, total, ALL_HEADS, DIM)
    slot_elements = LAYERS * 2 * max(chunk_lengths) * ALL_HEADS * DIM
    arena = torch.full((len(chunk_lengths) * slot_elements,), float("nan"))  # one server arena, its slots reversed
    pieces, at = [], 0
    for index, length in enumerate(chunk_lengths):  # each chunk a slot of its own, seen through the part's heads
        first = (len(chunk_lengths) - 1 - index) * slot_elements
        slot = arena[first : first + LAYERS * 2 * length * ALL_HEADS * DIM].view(LAYERS, 2, length, ALL_HEADS, DIM)
        slot.copy_(whole[:, :, at : at + length])
        pieces.append(LentPiece(start=at, kv=slot[:, :, :, head_range[0] : head_range[1]]))
        at += length
    num_blocks = (end - start) // SLOTS
    block_ids = torch.randperm(NUM_BLOCKS)[:num_blocks]
    lent, reference = engine_layers(kind, heads), engine_layers(kind, heads)
    compile_lent_scatter(lent)  # copies nothing
    assert all(torch.count_nonzero(layer.cache) == 0 for layer in lent)
    scatter_lent(lent, block_ids, pieces, start, end)
    if num_blocks:
        part = whole[:, :, start:end, head_range[0] : head_range[1]].contiguous()
        PagedChunk(reference, block_ids, part).scatter_all()
    for ours, theirs in zip(lent, reference, strict=True):
        assert torch.equal(ours.cache, theirs.cache)


def test_pieces_that_leave_a_gap_are_refused() -> None:
    layers = engine_layers("cpu", 1)
    arena = torch.zeros(LAYERS * 2 * 8 * ALL_HEADS * DIM * 2)
    slots = arena.view(2, LAYERS, 2, 8, ALL_HEADS, DIM)
    pieces = [LentPiece(start=0, kv=slots[0][:, :, :, :1]), LentPiece(start=12, kv=slots[1][:, :, :, :1])]
    with pytest.raises(InvalidInputError, match="cover the load in order"):
        scatter_lent(layers, torch.arange(1, 5), pieces, 0, 16)
