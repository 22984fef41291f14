"""The one-launch copy of every layer (``paged_triton.RequestKernel``), checked on the CPU under Triton's interpreter.

The kernel compiles for CUDA only; Triton's interpreter runs the same kernel source on CPU tensors when
``TRITON_INTERPRET=1`` is set as the module is loaded. So these tests load a second copy of the module with it set
(the package's own copy stays compiled-only) and hang its kernel on a ``PagedLayers`` built on the CPU: the copies
must match the per-layer ``index_select`` / ``index_copy_`` path bit for bit, for vLLM's CUDA formats (slot-major and
head-major) in every dtype, with a partly used last block. The compiled kernel is checked on the H200
(tests/connectors/test_paged_cuda.py). Where Triton is not installed these tests skip; ``make test`` installs it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.connectors import paged_triton
from kvstore.connectors.block_format import BlockFormat, PlaneMap
from kvstore.connectors.paged import PagedChunk, PagedLayers
from kvstore.errors import InvalidInputError
from tests.connectors.one_launch_checks import assert_one_launch_gathers_as_layer_by_layer

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@pytest.fixture(scope="module")
def interpreted() -> ModuleType:
    """``kvstore.connectors.paged_triton`` loaded again with ``TRITON_INTERPRET=1``: its kernel runs on the CPU."""
    pytest.importorskip("triton", reason="make test installs Triton (its interpreter runs the kernel on the CPU)")
    name = "kvstore_paged_triton_interpreted"
    spec = importlib.util.spec_from_file_location(name, paged_triton.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while building the class
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        spec.loader.exec_module(module)
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
    return module


def packed_caches(layers: int, blocks: int, heads: int, slots: int, dim: int, dtype: torch.dtype, slot_major: bool):
    """vLLM's CUDA caches, one tensor per layer: logical ``[blocks, heads, slots, 2*dim]``, random contents."""
    if slot_major:
        return [torch.randn(blocks, slots, heads, 2 * dim).to(dtype).permute(0, 2, 1, 3) for _ in range(layers)]
    return [torch.randn(blocks, heads, slots, 2 * dim).to(dtype) for _ in range(layers)]


def packed_format(cache: torch.Tensor, dim: int) -> BlockFormat:
    _, heads, slots, _ = cache.shape
    _, head_stride, token_stride, dim_stride = cache.stride()
    key = PlaneMap(offset=0, token_stride=token_stride, head_stride=head_stride, dim_stride=dim_stride)
    value = PlaneMap(offset=dim, token_stride=token_stride, head_stride=head_stride, dim_stride=dim_stride)
    return BlockFormat(block_size=slots, num_kv_heads=heads, head_dim=dim, key=key, value=value)


def with_interpreted_kernel(interpreted: ModuleType, caches: list[torch.Tensor], dim: int) -> PagedLayers:
    """The caches' ``PagedLayers`` with the interpreted kernel where the compiled one would be on CUDA."""
    layers = PagedLayers.of(caches, packed_format(caches[0], dim))
    assert layers.request_kernel is None, "on the CPU the package's own copy never runs the kernel"
    block_format = layers.block_format
    layers.request_kernel = interpreted.RequestKernel.of(
        caches,
        key_offset=block_format.key.offset,
        value_offset=block_format.value.offset,
        token_stride=block_format.key.token_stride,
        head_stride=block_format.key.head_stride,
        num_kv_heads=block_format.num_kv_heads,
        block_size=block_format.block_size,
        head_dim=block_format.head_dim,
    )
    assert layers.request_kernel is not None
    return layers


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_start_check_keeps_a_right_kernel_and_leaves_the_block_as_it_was(interpreted, dtype):
    caches = packed_caches(2, 4, 2, 4, 8, dtype, slot_major=True)
    before = [cache.clone() for cache in caches]
    layers = with_interpreted_kernel(interpreted, caches, 8)
    assert layers.check_request_kernel(block_id=2)
    assert layers.request_kernel is not None
    assert all(torch.equal(cache, was) for cache, was in zip(caches, before, strict=True))


class _WrongKernel:
    """The real kernel, miscompiled: its launches copy nothing, or fail to compile."""

    def __init__(self, real, fails: bool) -> None:
        self.first_cache, self._fails = real.first_cache, fails

    def launch(self, block_ids, chunk, num_tokens, *, scatter):
        if self._fails:
            raise RuntimeError("PTX assembly failed")


@pytest.mark.parametrize("fails", [False, True], ids=["copies-nothing", "does-not-compile"])
def test_the_start_check_turns_a_wrong_kernel_off(interpreted, fails, caplog):
    """A kernel that copies wrong (or raises) at the start check is dropped with one warning; the block it used is
    restored, and every later copy goes layer by layer, right."""
    caches = packed_caches(2, 4, 2, 4, 8, torch.float32, slot_major=False)
    before = [cache.clone() for cache in caches]
    layers = with_interpreted_kernel(interpreted, caches, 8)
    layers.request_kernel = _WrongKernel(layers.request_kernel, fails)
    assert not layers.check_request_kernel(block_id=1)
    assert layers.request_kernel is None
    assert all(torch.equal(cache, was) for cache, was in zip(caches, before, strict=True))
    assert "copies go layer by layer" in caplog.text
    source = torch.randn(2, 2, 4, 2, 8)
    scatter = PagedChunk(layers, torch.tensor([3]), source)
    assert not scatter.one_launch
    scatter.scatter_all()
    gathered = torch.empty_like(source)
    PagedChunk(layers, torch.tensor([3]), gathered).gather_all()
    assert torch.equal(gathered, source)


@settings(max_examples=20, deadline=None)
@given(
    num_layers=st.integers(1, 3),
    heads=st.sampled_from([1, 2, 3, 4]),
    slots=st.sampled_from([1, 4, 16]),
    dim=st.sampled_from([8, 16, 32]),
    dtype=st.sampled_from(DTYPES),
    slot_major=st.booleans(),
    data=st.data(),
)
def test_one_launch_copies_what_layer_by_layer_copies(
    interpreted, num_layers, heads, slots, dim, dtype, slot_major, data
):
    pool = 12
    caches = packed_caches(num_layers, pool, heads, slots, dim, dtype, slot_major)
    layers = with_interpreted_kernel(interpreted, caches, dim)
    used = data.draw(st.lists(st.integers(1, pool - 1), min_size=1, max_size=5, unique=True), label="block ids")
    ids = torch.tensor(used)
    num_tokens = data.draw(st.integers(1, len(used) * slots), label="tokens")

    gathered = torch.full((num_layers, 2, num_tokens, heads, dim), float("nan")).to(dtype)
    assert_one_launch_gathers_as_layer_by_layer(layers, ids, gathered)

    source = torch.randn(num_layers, 2, len(used) * slots, heads, dim).to(dtype)
    wanted = [cache.clone() for cache in caches]
    layerwise_scatter = PagedChunk(PagedLayers.of(wanted, layers.block_format), ids, source)
    for layer in range(num_layers):
        layerwise_scatter.scatter(layer)
    PagedChunk(layers, ids, source).scatter_all()
    assert all(torch.equal(cache, want) for cache, want in zip(caches, wanted, strict=True))


def test_formats_and_chunks_the_kernel_does_not_take_go_layer_by_layer(interpreted):
    """A head_dim that is not a power of two, a chunk that is not 16-byte aligned or in another dtype: no kernel
    (or no one launch), and ``*_all`` still copies right."""
    odd_dim = packed_caches(2, 6, 2, 4, 12, torch.float32, slot_major=True)
    block_format = packed_format(odd_dim[0], 12)
    assert (
        interpreted.RequestKernel.of(
            odd_dim,
            key_offset=0,
            value_offset=12,
            token_stride=block_format.key.token_stride,
            head_stride=block_format.key.head_stride,
            num_kv_heads=2,
            block_size=4,
            head_dim=12,
        )
        is None
    )
    caches = packed_caches(2, 6, 2, 4, 16, torch.bfloat16, slot_major=True)
    layers = with_interpreted_kernel(interpreted, caches, 16)
    ids = torch.tensor([4, 1])
    flat = torch.empty(2 * 2 * 8 * 2 * 16 + 1, dtype=torch.bfloat16)
    shifted = flat[1:].view(2, 2, 8, 2, 16)  # 2 bytes past an aligned start
    misaligned = PagedChunk(layers, ids, shifted)
    assert not misaligned.one_launch
    misaligned.gather_all()
    aligned = torch.empty(2, 2, 8, 2, 16, dtype=torch.bfloat16)
    PagedChunk(layers, ids, aligned).gather_all()
    assert torch.equal(shifted, aligned)
    with pytest.raises(InvalidInputError, match="float32"):  # a chunk of another dtype never reaches the kernel
        PagedChunk(layers, ids, aligned.float())


def test_without_the_kernel_every_layer_still_copies():
    """The CPU machines' path (no kernel): ``gather_all`` / ``scatter_all`` go layer by layer and round-trip."""
    caches = packed_caches(3, 8, 2, 4, 8, torch.float16, slot_major=False)
    layers = PagedLayers.of(caches, packed_format(caches[0], 8))
    ids = torch.tensor([6, 2, 5])
    source = torch.randn(3, 2, 12, 2, 8).to(torch.float16)
    scatter = PagedChunk(layers, ids, source)
    assert not scatter.one_launch
    scatter.scatter_all()
    gathered = torch.empty(3, 2, 10, 2, 8, dtype=torch.float16)
    PagedChunk(layers, ids, gathered).gather_all()
    assert torch.equal(gathered, source[:, :, :10])
    with pytest.raises(InvalidInputError, match="whole blocks"):
        PagedChunk(layers, ids, gathered).scatter_all()


def test_a_paged_cache_needs_layers_of_one_format():
    caches = packed_caches(2, 4, 2, 4, 8, torch.float32, slot_major=True)
    with pytest.raises(InvalidInputError, match="at least one layer"):
        PagedLayers([])
    slot_major = PagedLayers.of(caches[:1], packed_format(caches[0], 8))[0]
    head_major_cache = packed_caches(1, 4, 2, 4, 8, torch.float32, slot_major=False)[0]
    head_major = PagedLayers.of([head_major_cache], packed_format(head_major_cache, 8))[0]
    with pytest.raises(InvalidInputError, match="same block format"):
        PagedLayers([slot_major, head_major])
