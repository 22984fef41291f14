"""Paged copies of the two engine shapes that are not plain float K/V: an fp8 cache (``torch.uint8`` pages written
by a quantising kernel) and an MLA cache (one latent plane per block).

The writes emulate vLLM's CPU kernels in plain torch: the fp8 one quantises ``value / scale`` to the fp8 format and
stores its byte in vLLM's CPU block format (K transposed, then V); the MLA one stores ``[compressed | rope]`` rows of
``[blocks, 1, slots, latent]``, as ``AMXMLAImpl`` / ``CPUMLAImpl`` do. Copies must move bytes exactly: every byte value
(fp8 NaN codes included) round-trips (LMCache once corrupted fp8 KV by a layout assumption on the way back).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.connectors.block_format import probe_block_format
from kvstore.connectors.paged import PagedChunk, PagedLayers
from kvstore.errors import ConfigError
from tests.connectors.test_paged import write_cpu_transposed

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def write_fp8_cpu(cache: torch.Tensor, dim: int, fp8: torch.dtype, scale: float = 1.0):
    """vLLM's CPU fp8 write: ``value / scale`` rounded to ``fp8``, its byte stored in the CPU block format."""
    as_bytes = write_cpu_transposed(cache, dim)

    def write(key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        def quantise(tensor: torch.Tensor) -> torch.Tensor:
            return (tensor.float() / scale).to(fp8).view(torch.uint8)

        as_bytes(quantise(key), quantise(value), slot_mapping)

    return write


def write_mla(cache: torch.Tensor):
    rows = cache.view(-1, cache.shape[-1])

    def write(latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        rows[slot_mapping] = latent[:, 0].to(cache.dtype)

    return write


@pytest.mark.parametrize("fmt", sorted(FP8))
def test_an_fp8_cache_probes_to_the_float_format_and_copies_bytes_exactly(fmt: str) -> None:
    blocks, heads, slots, dim = 4, 2, 32, 64
    fp8_cache = torch.zeros(blocks, heads, slots, 2 * dim, dtype=torch.uint8)
    fp8_format = probe_block_format(
        fp8_cache,
        block_size=slots,
        num_kv_heads=heads,
        head_dim=dim,
        write=write_fp8_cpu(fp8_cache, dim, FP8[fmt]),
        storage_dtype=FP8[fmt],
        source_dtype=torch.float32,
    )
    float_cache = torch.zeros(blocks, heads, slots, 2 * dim, dtype=torch.bfloat16)
    float_format = probe_block_format(
        float_cache, block_size=slots, num_kv_heads=heads, head_dim=dim, write=write_cpu_transposed(float_cache, dim)
    )
    assert fp8_format == float_format  # element offsets: the same layout, one byte an element
    assert torch.count_nonzero(fp8_cache) == 0, "the probe zeroes block 0 after it"

    generator = torch.Generator().manual_seed(1)
    fp8_cache.copy_(torch.randint(0, 256, fp8_cache.shape, dtype=torch.uint8, generator=generator))
    layers = PagedLayers.of([fp8_cache], fp8_format)
    ids = torch.tensor([3, 1])
    chunk = torch.empty((1, 2, 2 * slots, heads, dim), dtype=torch.uint8)
    PagedChunk(layers, ids, chunk).gather_all()
    expected_k = torch.cat([fp8_format.plane_view(fp8_cache, 0)[block] for block in (3, 1)])
    assert torch.equal(chunk[0, 0], expected_k)

    target = torch.zeros_like(fp8_cache)
    PagedChunk(PagedLayers.of([target], fp8_format), torch.tensor([2, 0]), chunk).scatter_all()
    assert torch.equal(target[2], fp8_cache[3]) and torch.equal(target[0], fp8_cache[1])


def test_a_write_in_another_fp8_format_fails_the_probe() -> None:
    cache = torch.zeros(2, 1, 32, 64, dtype=torch.uint8)
    with pytest.raises(ConfigError, match="fp8 format is not the layout's"):
        probe_block_format(
            cache,
            block_size=32,
            num_kv_heads=1,
            head_dim=32,
            write=write_fp8_cpu(cache, 32, torch.float8_e5m2),
            storage_dtype=torch.float8_e4m3fn,
            source_dtype=torch.float32,
        )


def test_a_uint8_cache_needs_its_fp8_format_named() -> None:
    cache = torch.zeros(2, 1, 32, 64, dtype=torch.uint8)
    with pytest.raises(ConfigError, match="uint8"):
        probe_block_format(cache, block_size=32, num_kv_heads=1, head_dim=32, write=write_cpu_transposed(cache, 32))


@settings(max_examples=25, deadline=None)
@given(data=st.binary(min_size=2 * 32 * 32, max_size=2 * 32 * 32), block=st.integers(1, 3))
def test_every_byte_value_round_trips_through_the_blocks(data: bytes, block: int) -> None:
    slots, dim = 32, 32
    cache = torch.zeros(4, 1, slots, 2 * dim, dtype=torch.uint8)
    block_format = probe_block_format(
        cache,
        block_size=slots,
        num_kv_heads=1,
        head_dim=dim,
        write=write_fp8_cpu(cache, dim, torch.float8_e4m3fn),
        storage_dtype=torch.float8_e4m3fn,
        source_dtype=torch.bfloat16,
    )
    raw = bytearray(data)
    raw[:256] = bytes(range(256))  # every byte value, the fp8 NaN codes (0x7f, 0xff) among them
    source = torch.frombuffer(raw, dtype=torch.uint8).view(1, 2, slots, 1, dim)
    layers = PagedLayers.of([cache], block_format)
    ids = torch.tensor([block])
    PagedChunk(layers, ids, source).scatter_all()
    back = torch.empty_like(source)
    PagedChunk(layers, ids, back).gather_all()
    assert torch.equal(back, source)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_mla_cache_is_one_latent_plane(dtype: torch.dtype) -> None:
    blocks, slots, latent = 3, 16, 576
    cache = torch.zeros(blocks, 1, slots, latent, dtype=dtype)
    block_format = probe_block_format(
        cache, block_size=slots, num_kv_heads=1, head_dim=latent, write=write_mla(cache), num_planes=1
    )
    assert block_format.value is None and block_format.num_planes == 1
    assert (block_format.key.offset, block_format.key.token_stride, block_format.key.dim_stride) == (0, latent, 1)
    assert "latent at +0" in block_format.describe()

    cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(2)).to(dtype))
    layers = PagedLayers.of([cache, cache.clone()], block_format)
    chunk = torch.empty((2, 1, 2 * slots, 1, latent), dtype=dtype)
    PagedChunk(layers, torch.tensor([2, 1]), chunk).gather_all()
    assert torch.equal(chunk[1, 0, :slots, 0], cache[2, 0]) and torch.equal(chunk[0, 0, slots:, 0], cache[1, 0])
    target = PagedLayers.of([torch.zeros_like(cache), torch.zeros_like(cache)], block_format)
    PagedChunk(target, torch.tensor([1, 2]), chunk).scatter_all()
    assert torch.equal(target[0].cache[1], cache[2]) and torch.equal(target[1].cache[2], cache[1])
    tail = torch.empty((2, 1, 5, 1, latent), dtype=dtype)
    PagedChunk(layers, torch.tensor([2]), tail).gather_all()  # a partial last block
    assert torch.equal(tail[0, 0, :, 0], cache[2, 0, :5])
    with pytest.raises(Exception, match=r"\[1, tokens, 1, 576\]"):
        PagedChunk(layers, torch.tensor([2]), torch.empty((2, 2, 5, 1, latent), dtype=dtype))
