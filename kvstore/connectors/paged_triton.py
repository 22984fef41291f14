"""One kernel launch that copies a request's blocks of every layer at once (CUDA, when Triton imports).

Copying layer by layer costs one launch per layer and direction: on an H200 a Llama-8B request of 15K tokens moves
a layer in about 35 us, and each eager launch leaves the device idle for about 2 us between copies plus the host's
time before the first (docs/benchmarks.md, "Paged KV copies for vLLM"). Here one program copies one plane of one
block of one layer, and the grid covers every layer: the layers' tensors are separate allocations, so the kernel
reaches each through its element offset from the first layer's tensor (a table made once per engine), which keeps
every pointer a typed pointer the compiler can prove 16-byte aligned (so it issues 16-byte loads and stores).

Triton ships with every CUDA build of vLLM and PyTorch; where it does not import or the tensors are not on a GPU
(the CPU machines), or the format does not qualify, ``paged.PagedChunk`` copies layer by layer with
``index_select`` / ``index_copy_``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without Triton
    triton = None

__all__ = ["RequestKernel"]

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Under Triton's interpreter the kernel also runs on CPU tensors: how the tests check it on machines without a GPU."""
_ALIGNMENT_BYTES = 16
_ROWS_PER_STEP = 32
"""(slot, head) rows a program moves per step: 32 rows of a 128-dim bf16 head are 8 KiB in flight per program."""
_NUM_WARPS = 4


if triton is not None:

    @triton.jit(do_not_specialize=["num_tokens"])  # one compiled kernel whatever a request's length
    def _request_copy_kernel(
        first_cache_ptr,
        layer_offsets_ptr,
        block_ids_ptr,
        chunk_ptr,
        num_tokens,
        block_stride,
        key_offset,
        value_offset,
        token_stride,
        head_stride,
        chunk_layer_stride,
        chunk_plane_stride,
        NUM_HEADS: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        ROWS: tl.constexpr,
        ALIGNMENT: tl.constexpr,
        SCATTER: tl.constexpr,
    ):
        """Program (i, plane, layer) copies plane ``plane`` of block ``block_ids[i]`` of layer ``layer`` to (or,
        with SCATTER, from) chunk tokens ``[i*BLOCK_SIZE, (i+1)*BLOCK_SIZE)`` (those below ``num_tokens``)."""
        index = tl.program_id(0)
        plane = tl.program_id(1)
        layer = tl.program_id(2)
        layer_offset = tl.multiple_of(tl.load(layer_offsets_ptr + layer), ALIGNMENT)
        block_id = tl.load(block_ids_ptr + index).to(tl.int64)
        plane_offset = tl.where(plane == 0, key_offset, value_offset)
        cache_base = first_cache_ptr + layer_offset + block_id * block_stride + plane_offset
        chunk_base = (
            chunk_ptr
            + layer.to(tl.int64) * chunk_layer_stride
            + plane.to(tl.int64) * chunk_plane_stride
            + index.to(tl.int64) * (BLOCK_SIZE * NUM_HEADS * HEAD_DIM)
        )
        first_token = index * BLOCK_SIZE
        columns = tl.arange(0, HEAD_DIM)
        for first_row in tl.static_range(0, BLOCK_SIZE * NUM_HEADS, ROWS):  # the last step may pass the end
            rows = first_row + tl.arange(0, ROWS)
            slots = rows // NUM_HEADS
            heads = rows % NUM_HEADS
            in_chunk = ((rows < BLOCK_SIZE * NUM_HEADS) & (first_token + slots < num_tokens))[:, None]
            cache_at = cache_base + (slots * token_stride + heads * head_stride)[:, None] + columns[None, :]
            chunk_at = chunk_base + rows[:, None] * HEAD_DIM + columns[None, :]
            if SCATTER:
                tl.store(cache_at, tl.load(chunk_at, mask=in_chunk), mask=in_chunk)
            else:
                tl.store(chunk_at, tl.load(cache_at, mask=in_chunk), mask=in_chunk)


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestKernel:
    """The one-launch copy for one engine's layers, all of one block format (made once, when the engine registers
    its caches).

    Attributes:
        first_cache: layer 0's tensor; every layer is reached from its pointer.
        layer_offsets: int64 ``[layers]`` on the device, each layer's element offset from ``first_cache``.
        block_stride: elements from one block to the next (the same in every layer).
        key_offset, value_offset, token_stride, head_stride: the block format, in elements (head dims contiguous).
        num_kv_heads, block_size, head_dim: the block's shape.
    """

    first_cache: torch.Tensor
    layer_offsets: torch.Tensor
    block_stride: int
    key_offset: int
    value_offset: int
    token_stride: int
    head_stride: int
    num_kv_heads: int
    block_size: int
    head_dim: int

    @staticmethod
    def of(
        caches: list[torch.Tensor],
        *,
        key_offset: int,
        value_offset: int,
        token_stride: int,
        head_stride: int,
        num_kv_heads: int,
        block_size: int,
        head_dim: int,
    ) -> RequestKernel | None:
        """The kernel for ``caches`` (dim 0 indexing blocks), or ``None`` where it cannot run: no Triton, not CUDA,
        layers of different dtype, device or block stride, or a head_dim that is not a power of two. The caller has
        checked that each layer fuses (``paged.PagedLayer.wide_blocks``: head dims contiguous, K strided like V, every
        offset and stride 16-byte aligned), as the kernel's 16-byte loads and stores need."""
        first = caches[0]
        element = first.element_size()
        if (
            triton is None
            or (first.device.type != "cuda" and not _INTERPRETED)
            or any(
                cache.dtype != first.dtype or cache.device != first.device or cache.stride(0) != first.stride(0)
                for cache in caches
            )
            or head_dim & (head_dim - 1)  # a power of two: the kernel's columns are one tl.arange
        ):
            return None
        offsets = [(cache.data_ptr() - first.data_ptr()) // element for cache in caches]
        return RequestKernel(
            first_cache=first,
            layer_offsets=torch.tensor(offsets, dtype=torch.int64, device=first.device),
            block_stride=first.stride(0),
            key_offset=key_offset,
            value_offset=value_offset,
            token_stride=token_stride,
            head_stride=head_stride,
            num_kv_heads=num_kv_heads,
            block_size=block_size,
            head_dim=head_dim,
        )

    def launch(self, block_ids: torch.Tensor, chunk: torch.Tensor, num_tokens: int, *, scatter: bool) -> None:
        """Copy tokens ``[0, num_tokens)`` of every layer between blocks ``block_ids`` and ``chunk`` (checked by the
        caller, ``paged.PagedChunk``: the chunk fits the cache, 16-byte aligned, with enough blocks for the tokens)."""
        num_blocks = -(-num_tokens // self.block_size)
        if num_blocks == 0:
            return
        grid = (num_blocks, 2, len(self.layer_offsets))
        _request_copy_kernel[grid](
            self.first_cache,
            self.layer_offsets,
            block_ids,
            chunk,
            num_tokens,
            self.block_stride,
            self.key_offset,
            self.value_offset,
            self.token_stride,
            self.head_stride,
            chunk.stride(0),
            chunk.stride(1),
            NUM_HEADS=self.num_kv_heads,
            BLOCK_SIZE=self.block_size,
            HEAD_DIM=self.head_dim,
            ROWS=min(_ROWS_PER_STEP, triton.next_power_of_2(self.block_size * self.num_kv_heads)),
            ALIGNMENT=_ALIGNMENT_BYTES // chunk.element_size(),
            SCATTER=scatter,
            num_warps=_NUM_WARPS,
        )
