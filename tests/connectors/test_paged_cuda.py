"""CUDA twins of test_paged.py's round trips, for vLLM 0.32/0.33's packed CUDA format on CUDA tensors.

The cache is logical ``[blocks, heads, slots, 2*head_dim]`` (K then V on the last axis), physically slot-major
(``LBNHC``, vLLM's default: ``[blocks, slots, heads, 2*head_dim]`` in memory) or head-major (``LBHNC``), in bfloat16
and float16. The format is read both ways the connector reads it: probed through an emulated write kernel, and taken
from the tensor's strides as the worker does without a probe (``_packed_format``, whose logic is copied here since
``kvstore.connectors.vllm`` imports vLLM). The CPU twins in test_paged.py run everywhere; these need CUDA.
"""

from __future__ import annotations

import pytest
import torch

from kvstore.connectors.block_format import BlockFormat, PlaneMap, probe_block_format
from kvstore.connectors.paged import PagedChunk, PagedLayer, PagedLayers, gather_blocks, scatter_blocks
from tests.connectors.one_launch_checks import assert_one_launch_gathers_as_layer_by_layer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA (the cpu twins in test_paged.py run everywhere)"
    ),
]

DTYPES = (torch.bfloat16, torch.float16)
ORDERS = pytest.mark.parametrize("tokens_outer", [True, False], ids=["LBNHC", "LBHNC"])
CUDA = torch.device("cuda")


def packed_cache(num_blocks: int, heads: int, slots: int, dim: int, dtype: torch.dtype, tokens_outer: bool):
    """vLLM's CUDA cache: logical ``[blocks, heads, slots, 2*dim]``; physically slot-major or head-major."""
    if tokens_outer:
        return torch.zeros(num_blocks, slots, heads, 2 * dim, dtype=dtype, device=CUDA).permute(0, 2, 1, 3)
    return torch.zeros(num_blocks, heads, slots, 2 * dim, dtype=dtype, device=CUDA)


def write_packed(cache: torch.Tensor, dim: int):
    """vLLM's ``reshape_and_cache_flash`` in plain torch: token ``i`` into slot ``slot_mapping[i]``, K then V."""
    slots = cache.shape[2]

    def write(key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        blocks, offsets = slot_mapping // slots, slot_mapping % slots
        cache[blocks, :, offsets, :dim] = key
        cache[blocks, :, offsets, dim:] = value

    return write


def strides_format(cache: torch.Tensor, dim: int) -> BlockFormat:
    """The worker's format without a probe (``kvstore.connectors.vllm.worker_side._packed_format``)."""
    _, heads, slots, _ = cache.shape
    _, head_stride, token_stride, dim_stride = cache.stride()
    key = PlaneMap(offset=0, token_stride=token_stride, head_stride=head_stride, dim_stride=dim_stride)
    value = PlaneMap(offset=dim * dim_stride, token_stride=token_stride, head_stride=head_stride, dim_stride=dim_stride)
    return BlockFormat(block_size=slots, num_kv_heads=heads, head_dim=dim, key=key, value=value)


def probe(cache: torch.Tensor, dim: int) -> BlockFormat:
    _, heads, slots, _ = cache.shape
    return probe_block_format(cache, block_size=slots, num_kv_heads=heads, head_dim=dim, write=write_packed(cache, dim))


def random_chunk_layer(num_tokens: int, heads: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(2, num_tokens, heads, dim, device=CUDA).to(dtype)


def slot_mapping_of(block_ids: list[int], slots: int, num_tokens: int) -> torch.Tensor:
    return torch.tensor([block_ids[t // slots] * slots + t % slots for t in range(num_tokens)], device=CUDA)


@pytest.mark.parametrize("dtype", DTYPES)
@ORDERS
def test_gather_reads_what_the_engine_wrote_and_scatter_writes_what_it_would_read(dtype, tokens_outer):
    cache = packed_cache(9, 3, 8, 4, dtype, tokens_outer)
    block_format = probe(cache, 4)
    assert block_format == strides_format(cache, 4), "the probe and the worker's strides disagree"
    assert torch.count_nonzero(cache) == 0, "the probe leaves block 0 zeroed"

    written = random_chunk_layer(21, 3, 4, dtype)  # the last block partly used
    write_packed(cache, 4)(written[0], written[1], slot_mapping_of([5, 2, 7], 8, 21))
    gathered = torch.full((2, 21, 3, 4), float("nan"), dtype=dtype, device=CUDA)
    gather_blocks(cache, block_format, torch.tensor([5, 2, 7], device=CUDA), gathered)
    assert torch.equal(gathered, written)

    untouched = cache[[5, 2, 7]].clone()
    loaded = random_chunk_layer(16, 3, 4, dtype)
    scatter_blocks(cache, block_format, torch.tensor([3, 1], device=CUDA), loaded)
    reference = packed_cache(9, 3, 8, 4, dtype, tokens_outer)
    write_packed(reference, 4)(loaded[0], loaded[1], slot_mapping_of([3, 1], 8, 16))
    assert torch.equal(cache[[3, 1]], reference[[3, 1]])
    assert torch.equal(cache[[5, 2, 7]], untouched)


@pytest.mark.parametrize("dtype", DTYPES)
@ORDERS
def test_llama_shaped_blocks_round_trip_in_a_scattered_order(dtype, tokens_outer):
    """Llama-3.1-8B's KV shape (8 heads of 128, 16-slot blocks), 40 blocks drawn from a pool of 256."""
    heads, dim, slots, pool = 8, 128, 16, 256
    cache = packed_cache(pool, heads, slots, dim, dtype, tokens_outer)
    cache.copy_(torch.randn(cache.shape, device=CUDA).to(dtype))
    block_format = strides_format(cache, dim)
    generator = torch.Generator().manual_seed(3)
    ids = (torch.randperm(pool - 1, generator=generator)[:40] + 1).to(CUDA)
    before = cache.clone()

    source = random_chunk_layer(40 * slots, heads, dim, dtype)
    scatter_blocks(cache, block_format, ids, source)
    expected = before.clone()
    expected[ids] = torch.cat([source[0], source[1]], dim=-1).view(40, slots, heads, 2 * dim).permute(0, 2, 1, 3)
    assert torch.equal(cache, expected), "the scatter wrote other blocks or the wrong slots"

    gathered = torch.full((2, 40 * slots - 5, heads, dim), float("nan"), dtype=dtype, device=CUDA)
    gather_blocks(cache, block_format, ids, gathered)
    assert torch.equal(gathered, source[:, : 40 * slots - 5])


@pytest.mark.parametrize("seed", range(24))
def test_round_trip_through_blocks_for_random_shapes_and_block_orders(seed):
    """The twin of the CPU property test, with shapes and orders drawn from a seeded generator."""
    generator = torch.Generator().manual_seed(seed)

    def draw(values: list[int]) -> int:
        return values[int(torch.randint(len(values), (1,), generator=generator))]

    heads, slots, dim = draw([1, 2, 3, 4]), draw([1, 2, 4, 16]), draw([1, 2, 8, 128])
    num_blocks, dtype, tokens_outer = draw([2, 3, 4, 5, 6]), DTYPES[seed % 2], bool(seed // 2 % 2)
    cache = packed_cache(num_blocks, heads, slots, dim, dtype, tokens_outer)
    block_format = probe(cache, dim)
    order = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    used = draw(list(range(1, len(order) + 1)))
    ids = torch.tensor(order[:used], device=CUDA)
    chunk_layer = random_chunk_layer(used * slots, heads, dim, dtype)
    scatter_blocks(cache, block_format, ids, chunk_layer)
    num_tokens = draw(list(range(1, used * slots + 1)))
    gathered = torch.full((2, num_tokens, heads, dim), float("nan"), dtype=dtype, device=CUDA)
    gather_blocks(cache, block_format, ids, gathered)
    assert torch.equal(gathered, chunk_layer[:, :num_tokens])


@ORDERS
def test_a_request_chunk_in_host_memory_passes_through_one_device_buffer(tokens_outer):
    """A load retrieved into host memory: ``PagedChunk`` copies each layer through one device buffer (still the fused
    call); a gather into host memory comes back bit for bit, its partly used last block included."""
    heads, dim, slots, pool, layers = 8, 128, 16, 64, 3
    caches = [packed_cache(pool, heads, slots, dim, torch.bfloat16, tokens_outer) for _ in range(layers)]
    paged = PagedLayers([PagedLayer(cache, strides_format(cache, dim)) for cache in caches])
    ids = torch.tensor([9, 3, 40, 17], device=CUDA)
    untouched = [cache[[0, 1, 2]].clone() for cache in caches]
    host = torch.randn(layers, 2, 4 * slots, heads, dim).to(torch.bfloat16)
    scatter = PagedChunk(paged, ids, host)
    assert scatter.fused
    for layer in range(layers):
        scatter.scatter(layer)
    assert all(torch.equal(cache[[0, 1, 2]], before) for cache, before in zip(caches, untouched, strict=True))
    gathered = torch.full((layers, 2, 4 * slots - 3, heads, dim), float("nan"), dtype=torch.bfloat16)
    gather = PagedChunk(paged, ids, gathered)
    for layer in range(layers):
        gather.gather(layer)
    assert torch.equal(gathered, host[:, :, : 4 * slots - 3])
    on_device = torch.empty(layers, 2, 4 * slots, heads, dim, dtype=torch.bfloat16, device=CUDA)
    device_gather = PagedChunk(paged, ids, on_device)
    for layer in range(layers):
        device_gather.gather(layer)
    assert torch.equal(on_device.cpu(), host)


@ORDERS
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_layer_in_one_launch_copies_what_layer_by_layer_copies(tokens_outer, dtype):
    """Where Triton runs, ``gather_all`` / ``scatter_all`` are one kernel for every layer: the same bits as the
    per-layer copies, untouched blocks untouched, a partly used last block gathered up to the chunk's end."""
    pytest.importorskip("triton", reason="the one-launch copy needs Triton (vLLM's CUDA builds ship it)")
    heads, dim, slots, pool, layers = 8, 128, 16, 64, 4
    caches = [packed_cache(pool, heads, slots, dim, dtype, tokens_outer) for _ in range(layers)]
    paged = PagedLayers([PagedLayer(cache, strides_format(cache, dim)) for cache in caches])
    assert paged.request_kernel is not None
    before = [cache.clone() for cache in caches]
    assert paged.check_request_kernel(block_id=0)  # compiled and checked through block 0, whose bytes stay
    assert all(torch.equal(cache, was) for cache, was in zip(caches, before, strict=True))
    ids = torch.tensor([9, 3, 40, 17, 5], device=CUDA)
    untouched = [cache[[0, 1, 2, 4]].clone() for cache in caches]
    source = torch.randn(layers, 2, 5 * slots, heads, dim, device=CUDA).to(dtype)
    scatter = PagedChunk(paged, ids, source)
    assert scatter.one_launch
    scatter.scatter_all()
    assert all(torch.equal(cache[[0, 1, 2, 4]], before) for cache, before in zip(caches, untouched, strict=True))
    for num_tokens in (5 * slots, 4 * slots + 3, 1):
        gathered = torch.full((layers, 2, num_tokens, heads, dim), float("nan"), dtype=dtype, device=CUDA)
        assert_one_launch_gathers_as_layer_by_layer(paged, ids, gathered)
        assert torch.equal(gathered, source[:, :, :num_tokens])


def test_a_chunk_the_kernel_cannot_take_goes_layer_by_layer():
    """A chunk in host memory, or not 16-byte aligned, is not one launch; ``*_all`` still copies it right."""
    pytest.importorskip("triton", reason="the one-launch copy needs Triton (vLLM's CUDA builds ship it)")
    heads, dim, slots, pool, layers = 2, 64, 16, 16, 2
    caches = [packed_cache(pool, heads, slots, dim, torch.bfloat16, True) for _ in range(layers)]
    paged = PagedLayers([PagedLayer(cache, strides_format(cache, dim)) for cache in caches])
    ids = torch.tensor([3, 7], device=CUDA)
    host = torch.randn(layers, 2, 2 * slots, heads, dim).to(torch.bfloat16)
    through = PagedChunk(paged, ids, host)
    assert not through.one_launch
    through.scatter_all()
    odd = torch.empty(layers * 2 * 2 * slots * heads * dim + 1, dtype=torch.bfloat16, device=CUDA)
    shifted = odd[1:].view(layers, 2, 2 * slots, heads, dim)
    misaligned = PagedChunk(paged, ids, shifted)
    assert not misaligned.one_launch
    misaligned.gather_all()
    assert torch.equal(shifted.cpu(), host)
