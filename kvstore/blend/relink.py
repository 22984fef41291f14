"""Relinking stored sequences from their chunk records: which chunk continues which (``ContentCatalog.rebuild``).

The disk keeps each chunk's parent key (the previous chunk of its sequence), not the sequences. At open the content
index needs them back as *runs*: each sequence's chunks in order, so ``FingerprintIndex.register_runs`` can link
every chunk to the next (a document found at any offset is then covered to its partial last chunk)::

    records (any order):  c2 <- c1 <- c0        d1 <- d0       e0 (meta v1: no parent)
    runs:                 [c0 c1 c2]            [d0 d1]        [e0]

Rules: a chunk continues its parent when the parent is a full chunk that is among the records (a partial chunk
ends its sequence); of several children of one parent (sequences sharing a prefix) the first in input order
continues it and the others start runs of their own; a key that appears twice keeps its last record. Corrupt
parent keys that close a cycle leave those chunks without a head: each becomes a run of its own.

Everything is vectorised over numpy arrays of the keys' two 64-bit words (a million chunks in a fraction of a
second); a dict stands in when two distinct keys share their low word (about 1 in 10^7 data dirs of 1M chunks).

Pure functions; thread-safe.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvstore.errors import InvalidInputError
from kvstore.keys import KEY_BYTES, PrefixKey

__all__ = ["SequenceRuns", "sequence_runs"]

logger = logging.getLogger(__name__)

_NO_KEY = bytes(KEY_BYTES)


@dataclass(frozen=True, slots=True, kw_only=True)
class SequenceRuns:
    """Chunks ordered into runs: run ``r`` is chunks ``order[run_offsets[r]:run_offsets[r + 1]]``, each continuing
    the one before it. Chunks dropped as duplicates appear nowhere."""

    order: npt.NDArray[np.int64]
    run_offsets: npt.NDArray[np.int64]


def sequence_runs(
    keys: Sequence[PrefixKey], parent_keys: Sequence[PrefixKey | None], is_full: npt.NDArray[np.bool_]
) -> SequenceRuns:
    """Order chunks into runs by their parent keys (the rules are in the module docstring).

    Args:
        keys: each chunk's prefix key (16 bytes).
        parent_keys: each chunk's parent key, ``None`` when unknown (16 zero bytes mean the same, as on disk).
        is_full: each chunk has ``chunk_size`` tokens (only a full chunk can be continued).

    Raises:
        InvalidInputError: a key or parent key that is not 16 bytes, or inputs of different lengths.
    """
    num_chunks = len(keys)
    if len(parent_keys) != num_chunks or is_full.shape != (num_chunks,):
        raise InvalidInputError(f"got {len(parent_keys)} parent keys and {is_full.shape} flags for {num_chunks} keys")
    key_words = _words(keys)
    parent_words = _words([key or _NO_KEY for key in parent_keys])
    has_parent_key = (parent_words != 0).any(axis=1)  # all zeros means "no parent" on disk too (disk_format)
    kept, parent = _find_parents(keys, parent_keys, key_words, parent_words, has_parent_key)
    continues = kept & (parent >= 0)
    continues[continues] = is_full[parent[continues]]
    children = np.flatnonzero(continues)
    parents, first = np.unique(parent[children], return_index=True)  # first child of each parent, input order
    previous = np.full(num_chunks, -1, dtype=np.int64)
    previous[children[first]] = parents
    head, depth, looped = _heads_and_depths(previous)
    members = np.flatnonzero(kept & ~looped)
    order = members[np.lexsort((depth[members], head[members]))]
    run_heads = head[order]
    boundaries = np.flatnonzero(np.concatenate([[order.size > 0], run_heads[1:] != run_heads[:-1]]))
    run_offsets = np.concatenate([boundaries, [order.shape[0]]]).astype(np.int64)
    stranded = np.flatnonzero(kept & looped)
    if stranded.size:
        logger.warning("rebuild: %d chunks form cycles of parent keys; indexed without next links", stranded.size)
        run_offsets = np.concatenate([run_offsets, order.shape[0] + 1 + np.arange(stranded.size)])
        order = np.concatenate([order, stranded])
    return SequenceRuns(order=order.astype(np.int64), run_offsets=run_offsets)


def _words(keys: Sequence[bytes]) -> npt.NDArray[np.uint64]:
    """Keys as rows of two little-endian 64-bit words."""
    joined = b"".join(keys)
    if keys and set(map(len, keys)) != {KEY_BYTES}:
        raise InvalidInputError(f"every key and parent key must be {KEY_BYTES} bytes (kvstore.keys.PrefixKey)")
    return np.frombuffer(joined, dtype="<u8").reshape(len(keys), 2)


def _find_parents(
    keys: Sequence[PrefixKey],
    parent_keys: Sequence[PrefixKey | None],
    key_words: npt.NDArray[np.uint64],
    parent_words: npt.NDArray[np.uint64],
    has_parent_key: npt.NDArray[np.bool_],
) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.int64]]:
    """Which chunks are kept (the last record of each key), and each chunk's parent position (-1: none here)."""
    num_chunks = len(keys)
    by_key = np.lexsort((key_words[:, 1], key_words[:, 0]))  # stable: equal keys stay in input order
    low, high = key_words[by_key, 0], key_words[by_key, 1]
    is_last = np.ones(num_chunks, dtype=np.bool_)
    is_last[:-1] = (low[1:] != low[:-1]) | (high[1:] != high[:-1])
    by_key, low, high = by_key[is_last], low[is_last], high[is_last]
    kept = np.zeros(num_chunks, dtype=np.bool_)
    kept[by_key] = True
    if bool((low[1:] == low[:-1]).any()):  # distinct keys sharing a low word: look parents up exactly
        position = dict(zip(keys, range(num_chunks), strict=True))  # the last record of a key wins, as above
        parent = np.fromiter((position.get(key, -1) if key is not None else -1 for key in parent_keys),
                             dtype=np.int64, count=num_chunks)  # fmt: skip
        return kept, parent
    slot = np.minimum(np.searchsorted(low, parent_words[:, 0]), low.shape[0] - 1)
    found = has_parent_key & (low[slot] == parent_words[:, 0]) & (high[slot] == parent_words[:, 1])
    return kept, np.where(found, by_key[slot], -1).astype(np.int64)


def _heads_and_depths(
    previous: npt.NDArray[np.int64],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """Each chunk's run head and position in its run, by pointer doubling; and which chunks lie on a cycle.

    ``previous`` is injective (a parent keeps one child), so each chunk has one chain back; after ``log2`` rounds
    every chain has reached its head, and a chunk still jumping is on a cycle.
    """
    num_chunks = previous.shape[0]
    head = np.where(previous >= 0, previous, np.arange(num_chunks))
    depth = (previous >= 0).astype(np.int64)
    jump = previous.copy()
    active = np.flatnonzero(jump >= 0)
    for _ in range(num_chunks.bit_length() + 1):
        if not active.size:
            break
        hop = jump[active]
        head[active] = head[hop]
        depth[active] += depth[hop]
        jump[active] = jump[hop]
        active = active[jump[active] >= 0]
    looped = np.zeros(num_chunks, dtype=np.bool_)
    looped[active] = True
    return head, depth, looped
