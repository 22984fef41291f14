"""A lent load's KV into an engine's paged blocks, straight from the server's arena (``kvstore.wire.lent_kv``).

A retrieved load is one contiguous buffer, scattered whole (``PagedChunk``). A lent load is one view per chunk,
each a part's heads of a slot in the server's memory, and a chunk's edges need not fall on block edges (content-cut
chunks end anywhere). So each piece's whole blocks are scattered straight from its view, and the few blocks a
chunk edge cuts through are first put together in a small buffer of their own (one block per chunk edge at most),
then scattered: every byte is copied once from the arena, except those few blocks'.

Pure torch on the cache's device (host memory: lending is for a server on the engine's host without CUDA).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstore.connectors.paged import PagedChunk, PagedLayers
from kvstore.wire.lent_kv import LentPiece

__all__ = ["scatter_lent"]


def scatter_lent(
    layers: PagedLayers, block_ids: torch.Tensor, pieces: Sequence[LentPiece], start: int, end: int
) -> None:
    """Write tokens ``[start, end)`` of the lent ``pieces`` (in token order, covering that range without a gap)
    into ``block_ids`` (the blocks of those tokens, in order; ``start`` and ``end`` on block edges)."""
    block_size = layers.block_format.block_size
    cut: dict[int, list[tuple[LentPiece, int, int]]] = {}  # a block a piece edge cuts: the pieces' token ranges
    for piece in pieces:
        first, last = max(piece.start, start), min(piece.end, end)
        if first >= last:
            continue
        whole_from = -(-(first - start) // block_size)  # the piece's first and past-last whole blocks
        whole_to = (last - start) // block_size
        if whole_to > whole_from:
            rows = slice(start + whole_from * block_size - piece.start, start + whole_to * block_size - piece.start)
            PagedChunk(layers, block_ids[whole_from:whole_to], piece.kv[:, :, rows]).scatter_all()
        for block in {(first - start) // block_size, (last - 1 - start) // block_size}:
            if not whole_from <= block < whole_to:  # a block the piece only partly fills
                cut.setdefault(block, []).append((piece, first, last))
    if cut:
        _scatter_cut_blocks(layers, block_ids, cut, start, block_size)


def _scatter_cut_blocks(
    layers: PagedLayers,
    block_ids: torch.Tensor,
    cut: dict[int, list[tuple[LentPiece, int, int]]],
    start: int,
    block_size: int,
) -> None:
    """Assemble each block a piece edge cuts from the pieces that share it, then scatter them together."""
    blocks = sorted(cut)
    sample = cut[blocks[0]][0][0].kv
    staged = torch.empty(
        (sample.shape[0], sample.shape[1], len(blocks) * block_size, *sample.shape[3:]),
        dtype=sample.dtype,
        device=sample.device,
    )
    for index, block in enumerate(blocks):
        block_start = start + block * block_size
        for piece, first, last in cut[block]:
            lo, hi = max(first, block_start), min(last, block_start + block_size)
            at = index * block_size + lo - block_start
            staged[:, :, at : at + hi - lo] = piece.kv[:, :, lo - piece.start : hi - piece.start]
    PagedChunk(layers, block_ids[blocks], staged).scatter_all()
