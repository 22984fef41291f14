"""Many chunk-meta records decoded at once, as arrays: what opening a data dir reads (a million records for 1M chunks).

``decode_meta_batch`` accepts exactly the records ``format.decode_meta`` accepts (a 16-byte key, a known
version, a size that matches the token count, a checksum that matches) and decodes the same fields, but for a whole
batch with a few numpy operations and one numba call (``meta_checksum``) instead of Python code per record:
the values are copied once, into one buffer, and every field is read from it as little-endian ``u32`` words::

    word  0: version (low 16 bits) | reserved     1: num_tokens      2-3: source_start    4-5: raw bytes
    word  6-7: stored bytes    8: num_frames    9: frame_bytes    10-11: last access    12-13: checksum
    word 14-17: parent key (version 2)    then the tokens (from word 14 in version 1, 18 in version 2)

A record of ``4n + 1..3`` bytes is never valid; when a batch holds one, the others are copied again without it, so
every record starts on a word boundary. ``tests/tiers/disk/test_meta_batch.py`` checks the batch against
``decode_meta`` record by record, defects included.

Pure functions and immutable values; thread-safe.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import numpy.typing as npt

from kvstore.keys import KEY_BYTES, PrefixKey, TokenArray
from kvstore.keys import key_words as key_words_of
from kvstore.tiers.base import ContentRecords
from kvstore.tiers.disk.meta_checksum import meta_digests

__all__ = ["MetaBatch", "decode_meta_batch", "read_meta_batches"]

_FIXED_BYTES = 56  # the fixed fields, version 1's whole header
_TOKENS_WORD = {1: 14, 2: 18}  # version -> first token word
_PADDING = bytes(4 * 18)  # after the last record, so reading the longest header (version 2) stays inside the buffer
_NO_RECORDS = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True, slots=True, kw_only=True)
class MetaBatch:
    """The readable records of a batch, field by field (record ``i`` of the batch's readable ones), and the keys of
    the unreadable ones.

    Args:
        keys: each readable record's key.
        key_words: each readable record's key as two little-endian u64 words.
        num_tokens: tokens in the chunk.
        source_starts: position of the chunk's first token when its KV was computed.
        raw_bytes: uncompressed KV bytes.
        stored_bytes: bytes the chunk occupies in LMDB values.
        num_frames: codec frames.
        frame_bytes: raw bytes per frame.
        last_access_ns: last hit or write, ns since the epoch.
        parent_words: the parent key as two little-endian u64 words (``[0, 0]``: no parent, or a version 1 record).
        words: the batch's values as u32 words; chunk ``i``'s tokens are ``words[token_starts[i]:token_ends[i]]``.
        token_starts: each chunk's first token in ``words``.
        token_ends: the end of each chunk's tokens in ``words``.
        broken_keys: keys of records that ``decode_meta`` would refuse (a key of another length included, as read).
    """

    keys: list[PrefixKey]
    key_words: npt.NDArray[np.uint64]
    num_tokens: npt.NDArray[np.int64]
    source_starts: npt.NDArray[np.uint64]
    raw_bytes: npt.NDArray[np.int64]
    stored_bytes: npt.NDArray[np.int64]
    num_frames: npt.NDArray[np.int64]
    frame_bytes: npt.NDArray[np.int64]
    last_access_ns: npt.NDArray[np.uint64]
    parent_words: npt.NDArray[np.uint64]
    words: TokenArray
    token_starts: npt.NDArray[np.int64]
    token_ends: npt.NDArray[np.int64]
    broken_keys: list[PrefixKey]

    def __len__(self) -> int:
        return len(self.keys)

    def content(self, keep: npt.NDArray[np.bool_] | None = None) -> ContentRecords:
        """The content records of these chunks, or of those ``keep`` marks."""
        if keep is None or bool(keep.all()):
            return ContentRecords(
                keys=self.keys,
                key_words=self.key_words,
                parent_words=self.parent_words,
                source_starts=self.source_starts,
                tokens=self.words,
                token_starts=self.token_starts,
                token_ends=self.token_ends,
            )
        return ContentRecords(
            keys=[key for key, kept in zip(self.keys, keep.tolist(), strict=True) if kept],
            key_words=self.key_words[keep],
            parent_words=self.parent_words[keep],
            source_starts=self.source_starts[keep],
            tokens=self.words,
            token_starts=self.token_starts[keep],
            token_ends=self.token_ends[keep],
        )


def read_meta_batches(
    records: Iterator[tuple[bytes | memoryview, bytes | memoryview]], batch_records: int
) -> Iterator[MetaBatch]:
    """Decode ``records`` (key, value pairs, e.g. an LMDB cursor) ``batch_records`` at a time.

    Views into the map must stay valid until their batch is decoded (iterate inside the read transaction); no view
    is held past its batch.
    """
    while True:
        pairs = list(itertools.islice(records, batch_records))
        if not pairs:
            return
        keys, values = zip(*pairs, strict=True)
        del pairs
        yield decode_meta_batch(keys, values)


def decode_meta_batch(keys: Sequence[bytes | memoryview], values: Sequence[bytes | memoryview]) -> MetaBatch:
    """Decode meta records (``format``) into arrays; records ``decode_meta`` refuses go to ``broken_keys``."""
    num_records = len(keys)
    assert len(values) == num_records, "decode_meta_batch: one value per key (caller wiring)"
    joined_keys = b"".join(keys)
    if len(joined_keys) == KEY_BYTES * num_records:  # the usual case: every key is a prefix key
        # PrefixKey is a NewType: calling it per key would only cost time
        key_offsets = range(0, len(joined_keys), KEY_BYTES)
        key_list = cast(list[PrefixKey], [joined_keys[at : at + KEY_BYTES] for at in key_offsets])
        key_ok = np.ones(num_records, dtype=np.bool_)
        key_words = np.frombuffer(joined_keys, dtype="<u8").reshape(num_records, 2)
    else:
        key_list = [PrefixKey(bytes(key)) for key in keys]
        key_ok = np.fromiter((len(key) == KEY_BYTES for key in key_list), dtype=np.bool_, count=num_records)
        key_words = np.zeros((num_records, 2), dtype=np.uint64)
        key_words[key_ok] = key_words_of([key for key in key_list if len(key) == KEY_BYTES])
    sizes = np.fromiter(map(len, values), dtype=np.int64, count=num_records)
    whole_words = sizes % 4 == 0
    if bool(whole_words.all()):
        joined = b"".join(itertools.chain(values, (_PADDING,)))
        starts = np.cumsum(sizes) - sizes
    else:  # leave the values of 4n + 1..3 bytes out, so the others start on word boundaries
        kept = itertools.compress(values, whole_words.tolist())
        joined = b"".join(itertools.chain(kept, (_PADDING,)))
        starts = np.zeros(num_records, dtype=np.int64)
        starts[whole_words] = np.cumsum(sizes[whole_words]) - sizes[whole_words]
    words = np.frombuffer(joined, dtype="<u4")
    candidates = np.flatnonzero(key_ok & whole_words & (sizes >= _FIXED_BYTES))
    first_word = starts[candidates] // 4
    version = words[first_word] & 0xFFFF
    num_tokens = words[first_word + 1].astype(np.int64)
    tokens_word = np.select([version == 1, version == 2], [_TOKENS_WORD[1], _TOKENS_WORD[2]], default=-1)
    shape_ok = (tokens_word > 0) & (sizes[candidates] == 4 * (tokens_word + num_tokens))
    candidates, first_word, tokens_word = candidates[shape_ok], first_word[shape_ok], tokens_word[shape_ok]
    digests = meta_digests(words, 4 * first_word, sizes[candidates]) if candidates.size else _NO_RECORDS
    checksum_ok = digests == _word64(words, first_word + 12)
    readable, first_word, tokens_word = candidates[checksum_ok], first_word[checksum_ok], tokens_word[checksum_ok]
    is_readable = np.zeros(num_records, dtype=np.bool_)
    is_readable[readable] = True
    parent_words = np.zeros((readable.shape[0], 2), dtype=np.uint64)
    has_parent_field = tokens_word == _TOKENS_WORD[2]
    parent_words[has_parent_field, 0] = _word64(words, first_word[has_parent_field] + 14)
    parent_words[has_parent_field, 1] = _word64(words, first_word[has_parent_field] + 16)
    all_readable = readable.shape[0] == num_records
    return MetaBatch(
        keys=key_list if all_readable else [key_list[index] for index in readable.tolist()],
        key_words=key_words if all_readable else key_words[readable],
        num_tokens=words[first_word + 1].astype(np.int64),
        source_starts=_word64(words, first_word + 2),
        raw_bytes=_word64(words, first_word + 4).astype(np.int64),
        stored_bytes=_word64(words, first_word + 6).astype(np.int64),
        num_frames=words[first_word + 8].astype(np.int64),
        frame_bytes=words[first_word + 9].astype(np.int64),
        last_access_ns=_word64(words, first_word + 10),
        parent_words=parent_words,
        words=words,
        token_starts=first_word + tokens_word,
        token_ends=(starts[readable] + sizes[readable]) // 4,
        broken_keys=[] if all_readable else [key_list[index] for index in np.flatnonzero(~is_readable).tolist()],
    )


def _word64(words: npt.NDArray[np.uint32], word_idx: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
    """The little-endian u64 at each word index."""
    return words[word_idx].astype(np.uint64) | (words[word_idx + 1].astype(np.uint64) << np.uint64(32))
