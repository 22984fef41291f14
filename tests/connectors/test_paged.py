"""Paged KV <-> chunk copies: the block format is read back from a write function, then batched copies round-trip.

The write functions here emulate the engines' kernels in plain torch, element by element where the real kernel is
elementwise: vLLM 0.33's CUDA format (K|V on the last axis of ``[blocks, heads, slots, 2*head_dim]``, any physical
stride order), vLLM's CPU format (K transposed, then V, in each head of each block), and a packed-pair tile format
no strided view can express. The real kernels are probed in tests/vllm (CPU) and on the H200 (CUDA).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.connectors.block_format import BlockFormat, probe_block_format
from kvstore.connectors.paged import PagedChunk, PagedLayer, PagedLayers, gather_blocks, scatter_blocks
from kvstore.errors import ConfigError, InvalidInputError

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def packed_cache(num_blocks: int, heads: int, slots: int, dim: int, dtype: torch.dtype, tokens_outer: bool):
    """vLLM's CUDA cache: logical ``[blocks, heads, slots, 2*dim]``; physically slot-major (LBNHC) or head-major."""
    if tokens_outer:
        return torch.zeros(num_blocks, slots, heads, 2 * dim, dtype=dtype).permute(0, 2, 1, 3)
    return torch.zeros(num_blocks, heads, slots, 2 * dim, dtype=dtype)


def write_packed(cache: torch.Tensor, dim: int):
    def write(key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        slots = cache.shape[2]
        for index, slot in enumerate(slot_mapping.tolist()):
            block, offset = divmod(slot, slots)
            cache[block, :, offset, :dim] = key[index]
            cache[block, :, offset, dim:] = value[index]

    return write


def write_cpu_transposed(cache: torch.Tensor, dim: int):
    """vLLM's CPU backend: per block and head, K as ``[dim, slots]`` then V as ``[slots, dim]``."""
    num_blocks, heads, slots, _ = cache.shape

    def write(key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        raw = cache.view(num_blocks, heads, 2 * slots * dim)
        for index, slot in enumerate(slot_mapping.tolist()):
            block, offset = divmod(slot, slots)
            raw[block, :, : slots * dim].view(heads, dim, slots)[:, :, offset] = key[index]
            raw[block, :, slots * dim :].view(heads, slots, dim)[:, offset] = value[index]

    return write


def write_pair_tiles(cache: torch.Tensor, dim: int):
    """A tile format: K of slot pairs interleaved element by element (as VNNI packing does); not strided."""
    num_blocks, heads, slots, _ = cache.shape

    def write(key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        raw = cache.view(num_blocks, heads, 2, slots * dim)
        for index, slot in enumerate(slot_mapping.tolist()):
            block, offset = divmod(slot, slots)
            pair, within = divmod(offset, 2)
            tile = raw[block, :, 0, pair * 2 * dim : (pair + 1) * 2 * dim].view(heads, dim, 2)
            tile[:, :, within] = key[index]
            raw[block, :, 1].view(heads, slots, dim)[:, offset] = value[index]

    return write


def probe(cache: torch.Tensor, dim: int, writer) -> BlockFormat:
    _, heads, slots, _ = cache.shape
    return probe_block_format(cache, block_size=slots, num_kv_heads=heads, head_dim=dim, write=writer(cache, dim))


def fill(cache: torch.Tensor, dim: int, writer, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """Write random K/V for ``num_tokens`` tokens into ``block_ids`` with the engine's writer; returns them
    as a chunk layer ``[2, tokens, heads, dim]``."""
    _, heads, slots, _ = cache.shape
    chunk_layer = torch.randn(2, num_tokens, heads, dim).to(cache.dtype)
    slot_mapping = torch.tensor([block_ids[t // slots] * slots + t % slots for t in range(num_tokens)])
    writer(cache, dim)(chunk_layer[0], chunk_layer[1], slot_mapping)
    return chunk_layer


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("make", "writer"),
    [
        (lambda b, h, n, d, t: packed_cache(b, h, n, d, t, tokens_outer=True), write_packed),
        (lambda b, h, n, d, t: packed_cache(b, h, n, d, t, tokens_outer=False), write_packed),
        (lambda b, h, n, d, t: torch.zeros(b, h, n, 2 * d, dtype=t), write_cpu_transposed),
    ],
    ids=["cuda-slot-major", "cuda-head-major", "cpu-k-transposed"],
)
def test_gather_reads_what_the_engine_wrote_and_scatter_writes_what_it_would_read(dtype, make, writer):
    cache = make(9, 3, 8, 4, dtype)
    block_format = probe(cache, 4, writer)
    assert torch.count_nonzero(cache) == 0, "the probe leaves block 0 zeroed"

    written = fill(cache, 4, writer, [5, 2, 7], num_tokens=21)  # the last block partly used
    gathered = torch.empty(2, 21, 3, 4, dtype=dtype)
    gather_blocks(cache, block_format, torch.tensor([5, 2, 7]), gathered)
    assert torch.equal(gathered, written)

    untouched = cache[[5, 2, 7]].clone()
    loaded = torch.randn(2, 16, 3, 4).to(dtype)
    scatter_blocks(cache, block_format, torch.tensor([3, 1]), loaded)
    reference = make(9, 3, 8, 4, dtype)
    slot_mapping = torch.tensor([3 * 8 + t for t in range(8)] + [1 * 8 + t for t in range(8)])
    writer(reference, 4)(loaded[0], loaded[1], slot_mapping)  # what the engine's own write of `loaded` gives
    assert torch.equal(cache[[3, 1]], reference[[3, 1]])
    assert torch.equal(cache[[5, 2, 7]], untouched)


def test_the_cpu_format_is_read_as_k_transposed_then_v():
    cache = torch.zeros(4, 3, 8, 2 * 4)
    block_format = probe(cache, 4, write_cpu_transposed)
    slots, dim, heads = 8, 4, 3
    assert (block_format.key.token_stride, block_format.key.dim_stride) == (1, slots)
    assert (block_format.value.offset, block_format.value.token_stride, block_format.value.dim_stride) == (
        slots * dim,
        dim,
        1,
    )
    assert block_format.key.head_stride == block_format.value.head_stride == 2 * slots * dim
    assert heads == cache.shape[1]
    assert "K at +0" in block_format.describe()


def test_a_tile_format_that_is_not_strided_is_refused_with_one_line():
    cache = torch.zeros(4, 2, 8, 2 * 4)
    with pytest.raises(ConfigError, match="K block layout is not a strided") as caught:
        probe(cache, 4, write_pair_tiles)
    assert "\n" not in str(caught.value)


def test_a_write_that_drops_elements_is_refused():
    cache = torch.zeros(4, 2, 8, 2 * 4)

    def lossy(cache: torch.Tensor, dim: int):
        inner = write_packed(cache, dim)
        return lambda key, value, slots: inner(key[:-1], value[:-1], slots[:-1])

    with pytest.raises(ConfigError, match=r"stored .* of .* probe values"):
        probe(cache, 4, lossy)


def test_quantised_caches_are_refused():
    cache = torch.zeros(4, 2, 8, 8, dtype=torch.uint8)
    with pytest.raises(ConfigError, match="not supported"):
        probe(cache, 4, write_packed)


def test_scatter_needs_whole_blocks_and_gather_enough_blocks():
    cache = torch.zeros(4, 2, 8, 8)
    block_format = probe(cache, 4, write_packed)
    with pytest.raises(InvalidInputError, match="whole blocks"):
        scatter_blocks(cache, block_format, torch.tensor([1, 2]), torch.zeros(2, 12, 2, 4))
    with pytest.raises(InvalidInputError, match="do not fit"):
        gather_blocks(cache, block_format, torch.tensor([1]), torch.zeros(2, 9, 2, 4))
    with pytest.raises(InvalidInputError, match=r"is torch\.float64"):
        gather_blocks(cache, block_format, torch.tensor([1]), torch.zeros(2, 8, 2, 4, dtype=torch.float64))
    with pytest.raises(InvalidInputError, match="shape"):
        gather_blocks(cache, block_format, torch.tensor([1]), torch.zeros(2, 8, 4))


@settings(max_examples=40, deadline=None)
@given(
    heads=st.integers(1, 4),
    slots=st.sampled_from([1, 2, 4, 16]),
    dim=st.sampled_from([1, 2, 8]),
    num_blocks=st.integers(2, 6),
    tokens_outer=st.booleans(),
    cpu_format=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    data=st.data(),
)
def test_round_trip_through_blocks_for_any_shape_and_block_order(
    heads, slots, dim, num_blocks, tokens_outer, cpu_format, dtype, data
):
    if cpu_format:
        cache, writer = torch.zeros(num_blocks, heads, slots, 2 * dim, dtype=dtype), write_cpu_transposed
    else:
        cache, writer = packed_cache(num_blocks, heads, slots, dim, dtype, tokens_outer), write_packed
    block_format = probe(cache, dim, writer)
    block_ids = data.draw(st.permutations(range(1, num_blocks)))
    used = data.draw(st.integers(1, len(block_ids)))
    ids = torch.tensor(block_ids[:used])
    chunk_layer = torch.randn(2, used * slots, heads, dim).to(dtype)
    scatter_blocks(cache, block_format, ids, chunk_layer)
    num_tokens = data.draw(st.integers(1, used * slots))
    gathered = torch.empty(2, num_tokens, heads, dim, dtype=dtype)
    gather_blocks(cache, block_format, ids, gathered)
    assert torch.equal(gathered, chunk_layer[:, :num_tokens])


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_fused_path_moves_what_the_per_plane_path_moves(dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packed formats take one 16-byte-element call per layer; its bytes equal the plane-by-plane copies'."""
    import kvstore.connectors.paged as paged

    cache = packed_cache(7, 2, 8, 16, dtype, tokens_outer=True)
    block_format = probe(cache, 16, write_packed)
    layer = PagedLayer(cache, block_format)
    written = fill(cache, 16, write_packed, [6, 1, 4], num_tokens=21)
    fused = torch.empty(1, 2, 21, 2, 16, dtype=dtype)
    gather = PagedChunk(PagedLayers([layer]), torch.tensor([6, 1, 4]), fused)
    assert gather.fused
    gather.gather(0)
    loaded = torch.randn(1, 2, 16, 2, 16).to(dtype)
    PagedChunk(PagedLayers([layer]), torch.tensor([2, 5]), loaded).scatter(0)
    after_fused = cache.clone()

    monkeypatch.setattr(paged, "_wide_blocks", lambda *args: None)
    per_plane_layer = PagedLayer(cache, block_format)
    per_plane = torch.empty(1, 2, 21, 2, 16, dtype=dtype)
    per_plane_gather = PagedChunk(PagedLayers([per_plane_layer]), torch.tensor([6, 1, 4]), per_plane)
    assert not per_plane_gather.fused
    per_plane_gather.gather(0)
    PagedChunk(PagedLayers([per_plane_layer]), torch.tensor([2, 5]), loaded).scatter(0)
    assert torch.equal(fused[0], written) and torch.equal(per_plane[0], written)
    assert torch.equal(cache, after_fused)


def test_a_misaligned_chunk_or_a_transposed_format_takes_the_per_plane_path() -> None:
    cache = packed_cache(5, 2, 8, 16, torch.bfloat16, tokens_outer=False)
    layer = PagedLayer(cache, probe(cache, 16, write_packed))
    backing = torch.zeros(1, 2, 17, 2, 16, dtype=torch.bfloat16)
    shifted = backing[:, :, 1:]  # planes contiguous, starting one token (64 bytes) in: still 16-byte aligned
    assert PagedChunk(PagedLayers([layer]), torch.tensor([3, 1]), shifted).fused
    odd = torch.zeros(2 * 16 * 2 * 16 + 1, dtype=torch.bfloat16)[1:].view(1, 2, 16, 2, 16)  # 2 bytes off
    misaligned = PagedChunk(PagedLayers([layer]), torch.tensor([3, 1]), odd)
    assert not misaligned.fused
    written = fill(cache, 16, write_packed, [3, 1], num_tokens=16)
    misaligned.gather(0)
    assert torch.equal(odd[0], written)
    cpu_cache = torch.zeros(4, 2, 8, 32, dtype=torch.bfloat16)
    assert PagedLayer(cpu_cache, probe(cpu_cache, 16, write_cpu_transposed)).wide_blocks is None


@pytest.mark.parametrize("fused", [True, False])
def test_a_request_chunk_copies_every_layer_to_and_from_its_own_blocks(fused, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``PagedChunk`` of three layers: layer l of the chunk goes to (and comes from) layer l's cache only; a
    gather with a partly used last block fills exactly its tokens."""
    import kvstore.connectors.paged as paged

    if not fused:
        monkeypatch.setattr(paged, "_wide_blocks", lambda *args: None)
    caches = [packed_cache(6, 2, 4, 16, torch.bfloat16, tokens_outer=True) for _ in range(3)]
    block_format = probe(caches[0], 16, write_packed)
    layers = [PagedLayer(cache, block_format) for cache in caches]
    ids = torch.tensor([4, 2, 5])
    source = torch.randn(3, 2, 12, 2, 16).to(torch.bfloat16)
    untouched = [cache[[0, 1, 3]].clone() for cache in caches]
    scatter = PagedChunk(PagedLayers(layers), ids, source)
    assert scatter.fused is fused and scatter.num_tokens == 12
    for layer in range(3):
        scatter.scatter(layer)
    assert all(torch.equal(cache[[0, 1, 3]], before) for cache, before in zip(caches, untouched, strict=True))
    gathered = torch.full((3, 2, 10, 2, 16), math.nan, dtype=torch.bfloat16)
    gather = PagedChunk(PagedLayers(layers), ids, gathered)
    for layer in range(3):
        gather.gather(layer)
    assert torch.equal(gathered, source[:, :, :10])


def test_a_request_chunk_refuses_what_does_not_fit_in_one_line() -> None:
    cache = packed_cache(6, 2, 4, 16, torch.bfloat16, tokens_outer=True)
    layers = [PagedLayer(cache, probe(cache, 16, write_packed))]
    with pytest.raises(InvalidInputError, match="layers"):
        PagedChunk(PagedLayers(layers), torch.tensor([1]), torch.zeros(2, 2, 4, 2, 16, dtype=torch.bfloat16))
    with pytest.raises(InvalidInputError, match="do not fit"):
        PagedChunk(PagedLayers(layers), torch.tensor([1]), torch.zeros(1, 2, 5, 2, 16, dtype=torch.bfloat16))
    partial = PagedChunk(PagedLayers(layers), torch.tensor([1, 2]), torch.zeros(1, 2, 6, 2, 16, dtype=torch.bfloat16))
    partial.gather(0)
    with pytest.raises(InvalidInputError, match="whole blocks"):
        partial.scatter(0)
