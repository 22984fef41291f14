"""What a store publishes to the fleet directory: runs of chunks that reached the remote, with their content hashes.

A run is consecutive chunks of one stored sequence (every one full but the last), so other hosts' indexes get the
next links that find a document's partial last chunk. Under the write-through policy a store publishes the runs of
new chunks it just wrote; under the ``evict`` policy chunks reach the remote as the disk evicts them, and are
joined back into runs through their parent keys (a document's chunks usually leave together: they were stored and
used together). When a document's chunks leave in two evictions, the second run starts with the last chunk of the
first again, its hashes remembered by ``RecentRuns``: a receiving index links an entry that has no successor yet to
the chunk after it, so the partial last chunk is still found. Hashes only: ``kvstore.content.index.hash_chunks`` of
the tokens the store holds anyway.

Pure functions but for ``RemoteTier.publish`` (which queues the record behind the chunks' own writes).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np

from kvstore.content.index import hash_chunks
from kvstore.keys import PrefixKey, TokenArray
from kvstore.tiers.base import ChunkRecord
from kvstore.tiers.remote.directory import DirectoryRun
from kvstore.tiers.remote.tier import RemoteTier

__all__ = ["RecentRuns", "publish_records", "publish_span", "records_in_runs"]


def publish_span(
    remote: RemoteTier,
    tokens: TokenArray,
    keys: Sequence[PrefixKey],
    bounds: Sequence[int],
    fingerprint_bits: int,
) -> None:
    """Publish consecutive chunks ``keys`` of a sequence, chunk ``i`` being ``tokens[bounds[i]:bounds[i + 1]]``."""
    starts = np.asarray(bounds[:-1], dtype=np.int64)
    ends = np.asarray(bounds[1:], dtype=np.int64)
    _publish(remote, keys, tokens, starts, ends, int(bounds[0]), fingerprint_bits)


class RecentRuns:
    """The hashes of the last chunk of recently published runs, so a later run continuing one can start with it.

    Bounded (least recently published forgotten first); used by the disk writer thread only.

    Args:
        capacity: runs remembered.
    """

    def __init__(self, capacity: int = 65_536) -> None:
        self._capacity = capacity
        self._last: collections.OrderedDict[PrefixKey, DirectoryRun] = collections.OrderedDict()

    def remember(self, run: DirectoryRun) -> None:
        last = len(run.keys) - 1
        self._last[run.keys[last]] = _slice(run, last, run.source_start)
        while len(self._last) > self._capacity:
            self._last.popitem(last=False)

    def ending_with(self, key: PrefixKey | None) -> DirectoryRun | None:
        return self._last.get(key) if key is not None else None


def publish_records(remote: RemoteTier, run: Sequence[ChunkRecord], fingerprint_bits: int, recent: RecentRuns) -> None:
    """Publish one run of chunk records (``records_in_runs``), after the run it continues when ``recent`` knows it."""
    tokens = np.concatenate([record.tokens for record in run])
    ends = np.cumsum([record.num_tokens for record in run], dtype=np.int64)
    starts = np.concatenate(([0], ends[:-1])).astype(np.int64)
    keys = [record.key for record in run]
    contents = hash_chunks(tokens, starts, ends, fingerprint_bits)
    published = DirectoryRun(
        keys=tuple(keys),
        source_start=run[0].source_start,
        fingerprint_bits=contents.fingerprint_bits,
        fingerprints=contents.fingerprints,
        verifications=contents.verifications,
        lengths=contents.lengths,
    )
    before = recent.ending_with(run[0].parent_key)
    if (
        before is not None
        and before.fingerprint_bits == published.fingerprint_bits
        and before.source_start + int(before.lengths[0]) == published.source_start
    ):
        published = _joined(before, published)
    recent.remember(published)
    remote.publish(published)


def records_in_runs(records: Sequence[ChunkRecord]) -> list[list[ChunkRecord]]:
    """The records joined into runs by parent keys: a child follows a parent that ends where it starts (a parent
    shorter than ``chunk_size`` has a child when the store cut it at a separator)."""
    by_key = {record.key: record for record in records}
    child_of: dict[PrefixKey, ChunkRecord] = {}
    for record in records:
        parent = by_key.get(record.parent_key) if record.parent_key is not None else None
        if parent is not None and record.source_start == parent.source_start + parent.num_tokens:
            child_of[parent.key] = record
    followers = {child.key for child in child_of.values()}
    runs: list[list[ChunkRecord]] = []
    for record in records:
        if record.key in followers:
            continue
        run = [record]
        while (child := child_of.get(run[-1].key)) is not None and len(run) <= len(records):
            run.append(child)
        runs.append(run)
    return runs


def _slice(run: DirectoryRun, index: int, source_start: int) -> DirectoryRun:
    """Chunk ``index`` of a run as a run of its own, starting at ``source_start`` (its position)."""
    return DirectoryRun(
        keys=run.keys[index : index + 1],
        source_start=source_start + int(run.lengths[:index].sum()),
        fingerprint_bits=run.fingerprint_bits,
        fingerprints=run.fingerprints[index : index + 1],
        verifications=run.verifications[index : index + 1],
        lengths=run.lengths[index : index + 1],
    )


def _joined(first: DirectoryRun, second: DirectoryRun) -> DirectoryRun:
    return DirectoryRun(
        keys=first.keys + second.keys,
        source_start=first.source_start,
        fingerprint_bits=first.fingerprint_bits,
        fingerprints=np.concatenate([first.fingerprints, second.fingerprints]),
        verifications=np.concatenate([first.verifications, second.verifications]),
        lengths=np.concatenate([first.lengths, second.lengths]),
    )


def _publish(
    remote: RemoteTier,
    keys: Sequence[PrefixKey],
    tokens: TokenArray,
    starts: np.ndarray,
    ends: np.ndarray,
    source_start: int,
    fingerprint_bits: int,
) -> None:
    contents = hash_chunks(tokens, starts, ends, fingerprint_bits)
    remote.publish(
        DirectoryRun(
            keys=tuple(keys),
            source_start=source_start,
            fingerprint_bits=contents.fingerprint_bits,
            fingerprints=contents.fingerprints,
            verifications=contents.verifications,
            lengths=contents.lengths,
        )
    )
