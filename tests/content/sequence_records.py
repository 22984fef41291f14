"""Chunk records of stored sequences as test input for ``ContentRebuild``: one object per chunk, easy to shuffle,
drop parents from or corrupt, packed into the disk tier's ``ContentRecords`` batches as its recovery produces them."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvstore.content.catalog import ContentCatalog
from kvstore.keys import KEY_BYTES, PrefixKey, TokenArray
from kvstore.tiers.base import ContentRecords

_NO_KEY = bytes(KEY_BYTES)  # a parent key of zeros means "none known", as on disk
_BATCH_CHUNKS = 256


@dataclass(frozen=True, slots=True, kw_only=True)
class SequenceChunk:
    """One chunk of a stored sequence as the disk records it."""

    key: PrefixKey
    parent_key: PrefixKey | None
    source_start: int
    tokens: TokenArray


def batch_of_chunks(chunks: Sequence[SequenceChunk]) -> ContentRecords:
    """Chunks as one batch (their tokens concatenated), in the disk tier's own batch type."""
    ends = np.cumsum([chunk.tokens.shape[0] for chunk in chunks], dtype=np.int64)

    def words(keys: list[bytes]) -> npt.NDArray[np.uint64]:
        return np.frombuffer(b"".join(keys), dtype="<u8").reshape(len(keys), 2)

    return ContentRecords(
        keys=[chunk.key for chunk in chunks],
        key_words=words([chunk.key for chunk in chunks]),
        parent_words=words([chunk.parent_key or _NO_KEY for chunk in chunks]),
        source_starts=np.array([chunk.source_start for chunk in chunks], dtype=np.uint64),
        tokens=np.concatenate([chunk.tokens for chunk in chunks]),
        token_starts=np.concatenate([[0], ends[:-1]]).astype(np.int64),
        token_ends=ends,
    )


def rebuild_from(catalog: ContentCatalog, chunks: Iterable[SequenceChunk]) -> int:
    """Rebuild ``catalog``'s index from ``chunks`` (batches of 256, as the disk's recovery feeds it); chunks indexed."""
    rebuild = catalog.start_rebuild()
    iterator = iter(chunks)
    for batch in iter(lambda: list(itertools.islice(iterator, _BATCH_CHUNKS)), []):
        rebuild.add(batch_of_chunks(batch))
    return rebuild.finish()
