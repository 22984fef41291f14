"""Copies between a whole chunk and blocks of KV cache groups (vLLM's hybrid manager): each layer through its own
group's block ids, a load skipping the null block, a save refusing to read it. Layers of a group interleave as
Gemma 3's do (every third layer here), so the chunk's layers are strided views."""

from __future__ import annotations

import pytest
import torch

from kvstore.connectors.group_copies import GroupCopies, layer_runs
from kvstore.connectors.paged import PagedLayers
from kvstore.errors import InvalidInputError
from tests.connectors.test_paged import packed_cache, probe, write_packed

NUM_BLOCKS, HEADS, SLOTS, DIM = 12, 2, 4, 8
GROUP_OF = [0, 1, 2, 0, 1, 2]  # layers 0 and 3 in group 0, ...


def engine_layers() -> PagedLayers:
    caches = [packed_cache(NUM_BLOCKS, HEADS, SLOTS, DIM, torch.float32, tokens_outer=False) for _ in GROUP_OF]
    return PagedLayers.of(caches, probe(caches[0], DIM, write_packed))


def test_layer_runs_are_evenly_spaced_slices() -> None:
    assert layer_runs([0, 3]) == [slice(0, 4, 3)]
    assert layer_runs([1, 3, 5, 6]) == [slice(1, 6, 2), slice(6, 7, 1)]
    assert layer_runs([4]) == [slice(4, 5, 1)]


def test_a_save_gathers_each_layer_from_its_groups_blocks_and_a_load_skips_null_blocks() -> None:
    layers = engine_layers()
    copies = GroupCopies(layers, GROUP_OF)
    num_tokens = 3 * SLOTS
    chunk = torch.randn(len(GROUP_OF), 2, num_tokens, HEADS, DIM)
    groups = [(1, 2, 3), (4, 5, 6), (7, 8, 9)]
    copies.bind(groups, chunk, load=True).scatter_all()
    for layer, group in enumerate(GROUP_OF):
        other = [ids for index, ids in enumerate(groups) if index != group]
        for ids in other:  # another group's blocks of this layer stay untouched
            assert not layers[layer].cache[list(ids)].any()
    saved = torch.zeros_like(chunk)
    copies.bind(groups, saved, load=False).gather_all()
    assert torch.equal(saved, chunk)

    fresh = engine_layers()
    windowed = [(0, 2, 3), (0, 0, 6), (7, 8, 9)]  # sliding groups: the null block outside their window
    GroupCopies(fresh, GROUP_OF).bind(windowed, chunk, load=True).scatter_all()
    assert not any(layer.cache[0].any() for layer in fresh), "the null block received nothing"
    last = torch.zeros(len(GROUP_OF), 2, SLOTS, HEADS, DIM)
    GroupCopies(fresh, GROUP_OF).bind([(3,), (6,), (9,)], last, load=False).gather_all()
    assert torch.equal(last, chunk[:, :, 2 * SLOTS :]), "the window's blocks hold their tokens"
    with pytest.raises(InvalidInputError, match="null block of KV cache group 0"):
        GroupCopies(fresh, GROUP_OF).bind(windowed, torch.zeros_like(chunk), load=False)
