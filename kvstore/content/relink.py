"""Relinking stored sequences from their chunk records: which chunk continues which (``ContentCatalog.rebuild``).

The disk keeps each chunk's parent key (the previous chunk of its sequence), not the sequences. At open the content
index needs them back as *runs*: each sequence's chunks in order, so ``FingerprintIndex.register_runs`` can link
every chunk to the next (a document found at any offset is then covered to its partial last chunk)::

    records (any order):  c2 <- c1 <- c0        d1 <- d0       e0 (meta v1: no parent)
    runs:                 [c0 c1 c2]            [d0 d1]        [e0]

Rules: a chunk continues its parent when the parent is among the records (any chunk may have been continued: one
shorter than ``chunk_size`` ends its sequence, or a separator's run inside it); of several children of one parent
(sequences sharing a prefix) the first in input order continues it and the others start runs of their own; a key
that appears twice keeps its last record. Corrupt parent keys that close a cycle leave those chunks without a head:
each becomes a run of its own.

Two numba passes, O(n) for n chunks (a million in well under a second): a hash table from each key's two 64-bit
words to its last record finds every parent, then each run is walked from its head through the one child that
continues each chunk, heads in input order; chunks never reached lie on cycles.

Pure functions; thread-safe (the kernels release the GIL).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from numba import njit, types

from kvstore.errors import InvalidInputError
from kvstore.keys import KEY_BYTES, PrefixKey, key_words

__all__ = ["SequenceRuns", "sequence_runs", "sequence_runs_of_words"]

logger = logging.getLogger(__name__)

_NO_KEY = bytes(KEY_BYTES)


@dataclass(frozen=True, slots=True, kw_only=True)
class SequenceRuns:
    """Chunks ordered into runs: run ``r`` is chunks ``order[run_offsets[r]:run_offsets[r + 1]]``, each continuing
    the one before it. Chunks dropped as duplicates appear nowhere."""

    order: npt.NDArray[np.int64]
    run_offsets: npt.NDArray[np.int64]


def sequence_runs(
    keys: Sequence[PrefixKey], parent_keys: Sequence[PrefixKey | None]
) -> SequenceRuns:
    """Order chunks into runs by their parent keys (the rules are in the module docstring).

    Args:
        keys: each chunk's prefix key (16 bytes).
        parent_keys: each chunk's parent key, ``None`` when unknown (16 zero bytes mean the same, as on disk).

    Raises:
        InvalidInputError: a key or parent key that is not 16 bytes, or inputs of different lengths.
    """
    if len(parent_keys) != len(keys):
        raise InvalidInputError(f"got {len(parent_keys)} parent keys for {len(keys)} keys")
    return sequence_runs_of_words(_words(keys), _words([key or _NO_KEY for key in parent_keys]))


def sequence_runs_of_words(
    key_words: npt.NDArray[np.uint64], parent_words: npt.NDArray[np.uint64]
) -> SequenceRuns:
    """``sequence_runs`` of keys given as rows of two little-endian u64 words (``[0, 0]``: no parent), as the disk's
    content records carry them (no bytes object per key).

    Raises:
        InvalidInputError: arrays of other shapes than ``(n, 2)``, ``(n, 2)`` and ``(n,)``.
    """
    num_chunks = key_words.shape[0]
    if key_words.shape != (num_chunks, 2) or parent_words.shape != (num_chunks, 2):
        raise InvalidInputError(
            f"got key words {key_words.shape} and parent words {parent_words.shape}; give (n, 2) and (n, 2)"
        )
    key_low, key_high = (np.ascontiguousarray(key_words[:, column], dtype=np.uint64) for column in (0, 1))
    parent_low, parent_high = (np.ascontiguousarray(parent_words[:, column], dtype=np.uint64) for column in (0, 1))
    kept = np.ones(num_chunks, dtype=np.bool_)
    parent = np.empty(num_chunks, dtype=np.int64)
    _find_parents(key_low, key_high, parent_low, parent_high, kept, parent)
    order = np.empty(num_chunks, dtype=np.int64)
    run_offsets = np.zeros(num_chunks + 1, dtype=np.int64)
    counts = np.zeros(3, dtype=np.int64)  # chunks ordered, runs, chunks on cycles
    _walk_runs(kept, parent, order, run_offsets, counts)
    num_ordered, num_runs, num_looped = counts.tolist()
    if num_looped:
        logger.warning("rebuild: %d chunks form cycles of parent keys; indexed without next links", num_looped)
    return SequenceRuns(order=order[:num_ordered], run_offsets=run_offsets[: num_runs + 1])


def _words(keys: Sequence[bytes]) -> npt.NDArray[np.uint64]:
    """Keys as rows of two little-endian 64-bit words."""
    if keys and set(map(len, keys)) != {KEY_BYTES}:
        raise InvalidInputError(f"every key and parent key must be {KEY_BYTES} bytes (kvstore.keys.PrefixKey)")
    return key_words(keys)


_WORDS = types.Array(types.uint64, 1, "C", readonly=True)
_FLAGS = types.Array(types.bool_, 1, "C")
_POSITIONS = types.Array(types.int64, 1, "C")


@njit(types.void(_WORDS, _WORDS, _WORDS, _WORDS, _FLAGS, _POSITIONS), cache=True, nogil=True)
def _find_parents(key_low, key_high, parent_low, parent_high, kept, parent):  # type: ignore[no-untyped-def]
    """Mark the last record of each key ``kept`` (the others are duplicates) and set each chunk's ``parent`` to the
    kept record of its parent key (-1: no parent key, or none among the records). Open addressing, load <= 1/2."""
    num_chunks = key_low.shape[0]
    capacity_log2 = 1
    while (1 << capacity_log2) < 2 * num_chunks:
        capacity_log2 += 1
    capacity = 1 << capacity_log2
    mask = capacity - 1
    shift = np.uint64(64 - capacity_log2)
    table = np.full(capacity, -1, dtype=np.int64)
    for chunk in range(num_chunks):
        slot = np.int64(((key_low[chunk] ^ (key_high[chunk] * np.uint64(0x9E3779B97F4A7C15)))
                         * np.uint64(0xC2B2AE3D27D4EB4F)) >> shift)  # fmt: skip
        while True:
            other = table[slot]
            if other < 0:
                table[slot] = chunk
                break
            if key_low[other] == key_low[chunk] and key_high[other] == key_high[chunk]:
                table[slot] = chunk  # the last record of a key wins
                kept[other] = False
                break
            slot = (slot + 1) & mask
    for chunk in range(num_chunks):
        parent[chunk] = -1
        low, high = parent_low[chunk], parent_high[chunk]
        if low == 0 and high == 0:  # all zeros means "no parent" (format)
            continue
        slot = np.int64(((low ^ (high * np.uint64(0x9E3779B97F4A7C15))) * np.uint64(0xC2B2AE3D27D4EB4F)) >> shift)
        while True:
            other = table[slot]
            if other < 0:
                break
            if key_low[other] == low and key_high[other] == high:
                parent[chunk] = other
                break
            slot = (slot + 1) & mask


@njit(types.void(_FLAGS, _POSITIONS, _POSITIONS, _POSITIONS, _POSITIONS), cache=True, nogil=True)
def _walk_runs(kept, parent, order, run_offsets, counts):  # type: ignore[no-untyped-def]
    """Write the runs into ``order`` and ``run_offsets``, and into ``counts`` the chunks ordered, the runs and the
    chunks on cycles (each a run of its own, after the others)."""
    num_chunks = kept.shape[0]
    successor = np.full(num_chunks, -1, dtype=np.int64)
    continues = np.zeros(num_chunks, dtype=np.bool_)
    for chunk in range(num_chunks):  # the first child in input order continues its parent
        up = parent[chunk]
        if kept[chunk] and up >= 0 and successor[up] < 0:
            successor[up] = chunk
            continues[chunk] = True
    placed = np.zeros(num_chunks, dtype=np.bool_)
    num_ordered = 0
    num_runs = 0
    for head in range(num_chunks):  # heads in input order; a head's chain cannot loop (one child per parent)
        if kept[head] and not continues[head]:
            chunk = head
            while chunk >= 0:
                order[num_ordered] = chunk
                placed[chunk] = True
                num_ordered += 1
                chunk = successor[chunk]
            num_runs += 1
            run_offsets[num_runs] = num_ordered
    num_looped = 0
    for chunk in range(num_chunks):
        if kept[chunk] and not placed[chunk]:
            order[num_ordered] = chunk
            num_ordered += 1
            num_runs += 1
            run_offsets[num_runs] = num_ordered
            num_looped += 1
    counts[0], counts[1], counts[2] = num_ordered, num_runs, num_looped
