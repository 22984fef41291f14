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


def test_a_pipeline_stage_with_no_layer_of_some_groups_takes_every_groups_block_ids() -> None:
    """Gemma 3 at PP=2: the engine's groups are the whole model's, and a stage's layers fill only some of them; the
    scheduler sends block ids for all, and the stage copies its layers through its own groups' blocks alone."""
    stage_groups = [2, 3]  # this stage's two layers; groups 0 and 1 hold the other stage's
    caches = [packed_cache(NUM_BLOCKS, HEADS, SLOTS, DIM, torch.float32, tokens_outer=False) for _ in stage_groups]
    layers = PagedLayers.of(caches, probe(caches[0], DIM, write_packed))
    copies = GroupCopies(layers, stage_groups, num_groups=4)
    chunk = torch.randn(len(stage_groups), 2, 2 * SLOTS, HEADS, DIM)
    block_ids = [(0, 1), (0, 2), (0, 3), (4, 5)]  # the sliding groups null outside the window
    copies.bind(block_ids, chunk, load=True).scatter_all()
    assert not layers[0].cache[[0, 1, 2, 4, 5]].any(), "layer 0 (group 2) wrote its window's block 3 alone"
    assert not layers[1].cache[[0, 1, 2, 3]].any(), "layer 1 (group 3) wrote its blocks 4 and 5 alone"
    window = torch.zeros(len(stage_groups), 2, SLOTS, HEADS, DIM)
    copies.bind([(1,), (2,), (3,), (5,)], window, load=False).gather_all()  # groups 0 and 1: nothing read
    assert torch.equal(window, chunk[:, :, SLOTS:])
    with pytest.raises(InvalidInputError, match="block ids for 2 KV cache groups; the engine has 4"):
        copies.bind(block_ids[:2], chunk, load=True)
    with pytest.raises(InvalidInputError, match=r"layer groups \[2, 3\] outside the engine's 3 groups"):
        GroupCopies(layers, stage_groups, num_groups=3)
