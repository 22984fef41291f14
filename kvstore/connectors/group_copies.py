"""Copies between a chunk of every layer and a request's blocks when layers belong to KV cache groups, each group
with its own block table (vLLM's hybrid KV cache manager: a sliding-window group, a full-attention group).

The chunk stays whole (``[layers, planes, tokens, heads, head_dim]`` in model order, the store's identity of KV);
each layer moves through its own group's block ids. A group's layers are copied as runs of evenly spaced layers
(Gemma 3's groups are every sixth layer), each run one ``PagedChunk`` over a strided view of the chunk, so nothing
is copied twice and a save gathers straight into its staging. A scatter skips the null block (id 0): a sliding
group holds blocks only inside its window, and its null entries receive nothing. A gather never reads one.

One group holding every layer (no hybrid manager) is one ``PagedChunk`` over the engine's ``PagedLayers``, as
before: the one-launch copy where it runs.

Pure torch; not thread-safe per layer tensor (callers own their blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore.connectors.paged import PagedChunk, PagedLayers, device_block_ids
from kvstore.errors import InvalidInputError

__all__ = ["NULL_BLOCK_ID", "BoundCopies", "GroupCopies", "layer_runs"]

NULL_BLOCK_ID = 0
"""vLLM's null block: what a group's block table holds where it keeps no KV (a sliding window's freed blocks)."""


@dataclass(frozen=True, slots=True)
class _Run:
    """Evenly spaced layers of one group: ``chunk_layers`` selects them from a chunk, ``layers`` are their caches."""

    group: int
    chunk_layers: slice
    layers: PagedLayers


class BoundCopies:
    """A chunk bound to one request's blocks of every group: ``gather_all`` (a save) or ``scatter_all`` (a load)."""

    def __init__(self, chunks: Sequence[PagedChunk]) -> None:
        self._chunks = tuple(chunks)

    def gather_all(self) -> None:
        for chunk in self._chunks:
            chunk.gather_all()

    def scatter_all(self) -> None:
        for chunk in self._chunks:
            chunk.scatter_all()


class GroupCopies:
    """The engine's layers by KV cache group.

    Args:
        layers: every registered layer, in model order (the chunk's layer order).
        group_of: each layer's group (all 0: one group).
        num_groups: the engine's groups (``None``: ``max(group_of) + 1``). A pipeline stage's layers may leave some
            groups empty (Gemma 3's full-attention layer on another stage), yet block ids come for every group.

    Raises:
        InvalidInputError: ``group_of`` does not name a group below ``num_groups`` for each layer.
    """

    def __init__(self, layers: PagedLayers, group_of: Sequence[int], *, num_groups: int | None = None) -> None:
        if len(group_of) != len(layers):
            raise InvalidInputError(f"{len(group_of)} layer groups for {len(layers)} layers")
        self._layers = layers
        self.num_groups = num_groups if num_groups is not None else max(group_of, default=0) + 1
        if any(not 0 <= group < self.num_groups for group in group_of):
            raise InvalidInputError(f"layer groups {list(group_of)} outside the engine's {self.num_groups} groups")
        self._runs: list[_Run] = []
        if self.num_groups > 1:
            for group in range(self.num_groups):
                members = [index for index, of in enumerate(group_of) if of == group]
                for run in layer_runs(members):
                    selected = PagedLayers([layers[index] for index in range(len(layers))[run]])
                    selected.check_request_kernel(block_id=NULL_BLOCK_ID)  # vLLM never hands block 0 to a request
                    self._runs.append(_Run(group=group, chunk_layers=run, layers=selected))

    def bind(self, group_block_ids: Sequence[Sequence[int]], chunk: torch.Tensor, *, load: bool) -> BoundCopies:
        """``chunk`` bound to each group's ``group_block_ids`` (the blocks of the chunk's tokens, in order). A load
        writes whole blocks and skips null ones; a save reads a partly used last block and no null block.

        Raises:
            InvalidInputError: another number of groups, or a save that would read the null block.
        """
        if len(group_block_ids) != self.num_groups:
            raise InvalidInputError(
                f"block ids for {len(group_block_ids)} KV cache groups; the engine has {self.num_groups}"
            )
        device = self._layers[0].cache.device
        if self.num_groups == 1:
            return BoundCopies([PagedChunk(self._layers, device_block_ids(group_block_ids[0], device), chunk)])
        block_size = self._layers.block_format.block_size
        num_tokens = chunk.shape[2]
        chunks = []
        for run in self._runs:
            ids = group_block_ids[run.group]
            spans = _non_null_spans(ids)
            if not load and spans != [(0, len(ids))]:
                raise InvalidInputError(f"a save would read the null block of KV cache group {run.group}: {list(ids)}")
            for first, last in spans:
                tokens = chunk[run.chunk_layers, :, first * block_size : min(last * block_size, num_tokens)]
                chunks.append(PagedChunk(run.layers, device_block_ids(ids[first:last], device), tokens))
        return BoundCopies(chunks)


def layer_runs(indexes: Sequence[int]) -> list[slice]:
    """Ascending layer ``indexes`` as slices of evenly spaced layers, greedily longest first: ``[1, 3, 5, 6]`` ->
    ``[1:6:2, 6:7:1]``."""
    runs: list[slice] = []
    position = 0
    while position < len(indexes):
        first = indexes[position]
        if position + 1 == len(indexes):
            runs.append(slice(first, first + 1, 1))
            break
        step = indexes[position + 1] - first
        end = position + 1
        while end + 1 < len(indexes) and indexes[end + 1] - indexes[end] == step:
            end += 1
        runs.append(slice(first, indexes[end] + 1, step))
        position = end + 1
    return runs


def _non_null_spans(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """The ``[first, last)`` positions of ``block_ids`` between null blocks."""
    spans: list[tuple[int, int]] = []
    start: int | None = None
    for position, block_id in enumerate(block_ids):
        if block_id == NULL_BLOCK_ID:
            if start is not None:
                spans.append((start, position))
            start = None
        elif start is None:
            start = position
    if start is not None:
        spans.append((start, len(block_ids)))
    return spans
