"""Rebuilding the content index of a reopened data dir from the disk's chunk records, fed a batch at a time.

``ContentRebuild.add`` keeps each chunk's key, parent key and position and hashes its tokens (which are then
dropped); ``finish`` relinks the stored sequences through their parent keys (``relink``) and registers all of them
in one call (``FingerprintIndex.register_runs``). Being fed, not pulling, it can ride on the disk tier's own pass
over the meta records at open (``DiskTier(content_records=rebuild.add)``): one read of each record instead of two.

Threads: one ``ContentRebuild`` belongs to the thread that opens the store; ``finish`` takes the index's lock.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvstore.content.index import ChunkContents, FingerprintIndex
from kvstore.content.relink import sequence_runs_of_words
from kvstore.keys import PrefixKey, TokenArray

__all__ = ["ContentRebuild", "SequenceBatch"]

logger = logging.getLogger(__name__)

_MAX_POSITION = 2**32 - 1  # the index keeps source starts as u32


class SequenceBatch(Protocol):
    """Many chunks of stored sequences as the disk records them, without an object per chunk: chunk ``i`` has key
    ``keys[i]``, also as two little-endian u64 words ``key_words[i]``, parent key ``parent_words[i]`` in the same
    form (``[0, 0]``: none known), source start ``source_starts[i]`` and tokens
    ``tokens[token_starts[i]:token_ends[i]]`` (spans may skip data between them, e.g. record headers).

    The disk tier's ``ContentRecords`` is one (the catalog never imports a tier; the shape is the contract).
    """

    @property
    def keys(self) -> Sequence[PrefixKey]: ...

    @property
    def key_words(self) -> npt.NDArray[np.uint64]: ...

    @property
    def parent_words(self) -> npt.NDArray[np.uint64]: ...

    @property
    def source_starts(self) -> npt.NDArray[np.uint64]: ...

    @property
    def tokens(self) -> TokenArray: ...

    @property
    def token_starts(self) -> npt.NDArray[np.int64]: ...

    @property
    def token_ends(self) -> npt.NDArray[np.int64]: ...


class ContentRebuild:
    """One rebuild of a content index: ``add`` every batch of chunk records, then ``finish`` once.

    Rules (``finish``): every sequence is registered in order, a chunk with no known parent (chunk 0, a parent
    evicted, a meta v1 record) starting a run, so every chunk is indexed; only a next link may be lost. Chunks of no
    tokens, more than ``chunk_size`` tokens or a source start past 2**32 are skipped and counted in a warning.

    Args:
        index: the index to fill.
        chunk_size: tokens per full chunk.
    """

    def __init__(self, index: FingerprintIndex, chunk_size: int) -> None:
        self.index = index
        self.chunk_size = chunk_size
        self._keys: list[PrefixKey] = []
        self._key_words: list[npt.NDArray[np.uint64]] = []
        self._parent_words: list[npt.NDArray[np.uint64]] = []
        self._source_starts: list[npt.NDArray[np.uint64]] = []
        self._contents: list[ChunkContents] = []
        self._num_skipped = 0
        self._finished = False

    def add(self, batch: SequenceBatch) -> None:
        """Keep a batch's keys, parent keys and positions and hash its tokens (the batch is not held)."""
        assert not self._finished, "ContentRebuild.add after finish: the opener's wiring"
        lengths = batch.token_ends - batch.token_starts
        starts = batch.source_starts.astype(np.uint64)
        in_range = starts <= np.uint64(_MAX_POSITION)  # then the int64 view below cannot wrap
        ends = np.where(in_range, starts, 0).astype(np.int64) + lengths
        usable = in_range & (lengths >= 1) & (lengths <= self.chunk_size) & (ends <= _MAX_POSITION)
        if bool(usable.all()):
            self._keys += batch.keys
        else:
            self._num_skipped += int((~usable).sum())
            self._keys += [key for key, use in zip(batch.keys, usable.tolist(), strict=True) if use]
        if bool(usable.any()):
            self._key_words.append(batch.key_words[usable])
            self._parent_words.append(batch.parent_words[usable])
            self._source_starts.append(starts[usable])
            self._contents.append(
                self.index.chunk_contents(batch.tokens, batch.token_starts[usable], batch.token_ends[usable])
            )

    def finish(self) -> int:
        """Relink the sequences and register them all.

        Returns:
            Chunks indexed.
        """
        assert not self._finished, "ContentRebuild.finish twice: the opener's wiring"
        self._finished = True
        if self._num_skipped:
            logger.warning("rebuild: skipped %d chunks of no tokens, over chunk_size=%d tokens or past position 2**32",
                           self._num_skipped, self.chunk_size)  # fmt: skip
        if not self._keys:
            return 0
        keys = self._keys
        hashed = ChunkContents.concatenate(self._contents, self.index.fingerprint_bits)
        runs = sequence_runs_of_words(np.concatenate(self._key_words), np.concatenate(self._parent_words))
        self.index.register_runs(
            hashed.take(runs.order),
            list(map(keys.__getitem__, runs.order.tolist())),
            np.concatenate(self._source_starts)[runs.order].astype(np.int64),
            runs.run_offsets,
            self.chunk_size,
        )
        self._keys, self._key_words, self._parent_words, self._source_starts, self._contents = [], [], [], [], []
        return int(runs.order.shape[0])
