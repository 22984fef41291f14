"""A store call's writes: each chunk handed over is written, found held, recorded as an alias or rejected, and the
committed runs are registered by content.

A new chunk goes to the fastest local tier with room (``LocalTiers.put_new``: the durable tier takes a
write-through) and to the fleet (``Fleet.wrote``); with blending on it stays pinned (shielded from eviction) until
its content registration has run. The call's result lists every chunk with its ``ChunkOutcome``, so a caller never
asks the tiers again what the store did.

Threads: any number of callers; ``ChunkWriter`` holds no state of its own (the tiers, the fleet and the catalog
guard theirs).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore.content.catalog import ContentCatalog
from kvstore.content.index import Match
from kvstore.keys import PrefixKey, TokenArray
from kvstore.plan import ChunkOutcome, ChunkResult, StoreResult
from kvstore.store.fleet import Fleet
from kvstore.store.local_tiers import LocalTiers
from kvstore.store.pins import Pin
from kvstore.tiers.base import ChunkRecord, Tier

__all__ = ["ChunkWriter", "CutSequence"]

logger = logging.getLogger(__name__)


def _no_op() -> None:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class CutSequence:
    """A stored sequence cut into chunks, and the part of it a store call hands over.

    Args:
        tokens: the sequence's token ids, from position 0.
        bounds: chunk ``i`` is ``tokens[bounds[i]:bounds[i + 1]]``.
        keys: each chunk's prefix key.
        first_index: the first chunk handed over (its KV starts at ``start``).
        start: the position of the handed-over KV's first token, ``bounds[first_index]`` or past the last chunk.
    """

    tokens: TokenArray
    bounds: Sequence[int]
    keys: Sequence[PrefixKey]
    first_index: int
    start: int


class ChunkWriter:
    """Writes a store call's chunks into the local tiers and the fleet, and registers them by content.

    Args:
        tiers: the store's local tiers.
        fleet: the store's shared tiers.
        catalog: the content catalog (``None``: blending off, nothing is registered or aliased).
    """

    def __init__(self, tiers: LocalTiers, fleet: Fleet, catalog: ContentCatalog | None) -> None:
        self._tiers = tiers
        self._fleet = fleet
        self._catalog = catalog

    def put_new(self, record: ChunkRecord, kv: torch.Tensor) -> Tier | None:
        """A chunk into the fastest local tier with room, then to the fleet; returns the tier (``None``: rejected)."""
        tier = self._tiers.put_new(record, kv)
        if tier is not None:
            self._fleet.wrote(tier, record, kv)
        return tier

    def write(self, sequence: CutSequence, kv: torch.Tensor) -> StoreResult:
        """Write the chunks from ``sequence.first_index``; ``kv`` holds ``tokens[start:]``.

        The chunks before ``first_index`` are never written; those resident are registered by content with the
        tail, as one sequence, exactly as a store of the whole sequence would register them.
        """
        catalog = self._catalog
        tokens, bounds, keys, first_index = sequence.tokens, sequence.bounds, sequence.keys, sequence.first_index
        # Indexed from the first chunk written, cut where the whole sequence is cut.
        first_start = bounds[first_index]
        dedup = (
            catalog.dedup_targets(tokens[first_start:], [bound - first_start for bound in bounds[first_index + 1 :]])
            if catalog is not None
            else []
        )
        committed = [False] * len(keys)  # resident after this call, so its content may be registered
        if catalog is not None:
            for index in range(first_index):  # not written, but registered with the tail as a full store would
                committed[index] = self._is_resident(keys[index])
        shields: list[Pin] = []
        chunks: list[ChunkResult] = []
        for index in range(first_index, len(keys)):
            key = keys[index]
            if self._tiers.holds(key):
                outcome = ChunkOutcome.HELD
                committed[index] = True
            elif catalog is not None and catalog.is_alias(key):
                outcome = ChunkOutcome.HELD
            else:
                position = index - first_index
                target = dedup[position] if position < len(dedup) else None
                outcome = self._write_new(sequence, index, kv, target, shields)
                committed[index] = outcome is ChunkOutcome.WRITTEN
            chunks.append(ChunkResult(key=key, start=bounds[index], end=bounds[index + 1], outcome=outcome))
        result = StoreResult.of(chunks)
        if result.num_rejected_chunks:
            logger.warning("store: %d of %d chunks rejected, every tier is pinned full",
                           result.num_rejected_chunks, result.num_chunks)  # fmt: skip
        if catalog is not None:
            self._register_runs(catalog, sequence, committed, shields)
        written = ChunkOutcome.WRITTEN
        new_indexes = [index for index, chunk in enumerate(chunks, first_index) if chunk.outcome is written]
        self._fleet.stored(tokens, keys, bounds, new_indexes)
        return result

    def _write_new(
        self, sequence: CutSequence, index: int, kv: torch.Tensor, target: Match | None, shields: list[Pin]
    ) -> ChunkOutcome:
        """Write chunk ``index``, which no tier holds; ``target``: a stored chunk of the same content under another
        key (dedup-content), which makes it an alias of that copy instead."""
        key = sequence.keys[index]
        if target is not None and target.key != key:
            assert self._catalog is not None, "a dedup target comes from the content catalog"
            self._catalog.add_alias(key, target)
            return ChunkOutcome.ALIASED
        bounds = sequence.bounds
        chunk_start, chunk_end = bounds[index], bounds[index + 1]
        record = ChunkRecord(
            key=key,
            source_start=chunk_start,
            tokens=sequence.tokens[chunk_start:chunk_end],
            parent_key=sequence.keys[index - 1] if index else None,
        )
        tier = self.put_new(record, kv[:, :, chunk_start - sequence.start : chunk_end - sequence.start])
        if tier is None:
            return ChunkOutcome.REJECTED
        if self._catalog is not None and tier.pin(key):
            shields.append((tier, key))  # shielded from eviction until its registration has run
        return ChunkOutcome.WRITTEN

    def _is_resident(self, key: PrefixKey) -> bool:
        return self._tiers.holds(key) or self._fleet.knows(key) is not None

    def _register_runs(
        self, catalog: ContentCatalog, sequence: CutSequence, committed: Sequence[bool], shields: Sequence[Pin]
    ) -> None:
        """Queue each run of consecutive committed chunks for content registration; the last run drops the shields."""
        runs: list[tuple[int, int]] = []
        for index, is_committed in enumerate(committed):
            if not is_committed:
                continue
            if runs and runs[-1][1] == index:
                runs[-1] = (runs[-1][0], index + 1)
            else:
                runs.append((index, index + 1))
        if not runs:
            _unpin(shields)
            return
        bounds, keys = sequence.bounds, sequence.keys
        for position, (first, last) in enumerate(runs):
            start, end = bounds[first], bounds[last]
            # Runs register in order, so the last one's completion means every shield can go.
            on_done = (lambda: _unpin(shields)) if position == len(runs) - 1 else _no_op
            chunk_ends = [bound - start for bound in bounds[first + 1 : last + 1]]
            catalog.register(sequence.tokens[start:end], keys[first:last], start, on_done, chunk_ends=chunk_ends)


def _unpin(pins: Sequence[Pin]) -> None:
    for tier, key in pins:
        tier.unpin(key)
