"""Content hashes of chunks: the fingerprint and verification hash the content index keys its entries by.

A chunk's content is three numbers: its fingerprint (``kvstore.content.rolling_hash``, cut to an index's
``fingerprint_bits``), an independent xxh3_64 of its token bytes (the verification hash) and its length. The index
hashes the chunks it registers or looks up here, and the store hashes chunks without an index at hand (a fleet
directory record, a disk record streamed past at rebuild) and registers them later with
``FingerprintIndex.register_runs``. Also here: the chunk-size and chunk-end checks every index call shares.

Threads: pure functions over their arguments; the numba kernel releases the GIL.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import xxhash

from kvstore.content import fingerprint_table as table
from kvstore.errors import ConfigError, InvalidInputError
from kvstore.keys import TokenArray, as_token_array, num_chunks

__all__ = [
    "DEFAULT_FINGERPRINT_BITS",
    "MAX_CHUNK_TOKENS",
    "ChunkContents",
    "check_chunk_size",
    "hash_chunks",
    "sequence_chunk_ends",
]

DEFAULT_FINGERPRINT_BITS = 64
"""Fingerprint bits of a production index (tests lower them to force collisions)."""
MAX_CHUNK_TOKENS = 2**16 - 1
"""The longest chunk an index holds: its length is a u16 column."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkContents:
    """The content hashes of many chunks (``FingerprintIndex.chunk_contents``), for ``register_runs``.

    Lets a caller hash chunks as they stream past, drop their tokens, and register them later in any order.

    Attributes:
        fingerprints: each chunk's fingerprint, cut to ``fingerprint_bits``.
        verifications: each chunk's xxh3_64 of its token bytes.
        lengths: each chunk's tokens.
        fingerprint_bits: the bits of the index that computed them (only such an index may register them).
    """

    fingerprints: npt.NDArray[np.uint64]
    verifications: npt.NDArray[np.uint64]
    lengths: npt.NDArray[np.uint16]
    fingerprint_bits: int

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def take(self, order: npt.NDArray[np.int64]) -> ChunkContents:
        """The chunks at positions ``order``, in that order."""
        return ChunkContents(
            fingerprints=self.fingerprints[order],
            verifications=self.verifications[order],
            lengths=self.lengths[order],
            fingerprint_bits=self.fingerprint_bits,
        )

    @staticmethod
    def concatenate(parts: Sequence[ChunkContents], fingerprint_bits: int) -> ChunkContents:
        """The chunks of ``parts``, one after the other (all computed by indexes of ``fingerprint_bits``)."""
        if any(part.fingerprint_bits != fingerprint_bits for part in parts):
            raise InvalidInputError("ChunkContents of indexes with different fingerprint_bits cannot be joined")
        return ChunkContents(
            fingerprints=np.concatenate([part.fingerprints for part in parts] or [np.empty(0, np.uint64)]),
            verifications=np.concatenate([part.verifications for part in parts] or [np.empty(0, np.uint64)]),
            lengths=np.concatenate([part.lengths for part in parts] or [np.empty(0, np.uint16)]),
            fingerprint_bits=fingerprint_bits,
        )


def hash_chunks(
    tokens: TokenArray,
    chunk_starts: npt.NDArray[np.int64],
    chunk_ends: npt.NDArray[np.int64],
    fingerprint_bits: int = DEFAULT_FINGERPRINT_BITS,
) -> ChunkContents:
    """Hash many chunks at once: chunk ``i`` is ``tokens[chunk_starts[i]:chunk_ends[i]]``.

    The spans may lie anywhere in ``tokens`` (in any order, with gaps), so a caller can hash chunks where they
    already are, e.g. in a buffer of disk records between their headers.

    Args:
        tokens: token ids holding every chunk.
        chunk_starts: each chunk's first token position.
        chunk_ends: each chunk's end position; every chunk has 1 to 65535 tokens.
        fingerprint_bits: bits kept of each fingerprint (an index registers only contents of its own bits).

    Raises:
        InvalidInputError: spans outside ``tokens``, empty or too long, or arrays of different lengths.
    """
    tokens = as_token_array(tokens)
    starts = np.asarray(chunk_starts, dtype=np.int64)
    ends = np.asarray(chunk_ends, dtype=np.int64)
    lengths = ends - starts
    if (
        starts.ndim != 1
        or starts.shape != ends.shape
        or (
            starts.size
            and (
                int(starts.min()) < 0
                or int(ends.max()) > tokens.shape[0]
                or int(lengths.min()) < 1
                or int(lengths.max()) > MAX_CHUNK_TOKENS
            )
        )
    ):
        raise InvalidInputError(
            f"chunk spans must lie in [0, len(tokens)={tokens.shape[0]}] and hold 1 to {MAX_CHUNK_TOKENS} "
            "tokens each, one start and one end per chunk"
        )
    fingerprints = np.empty(starts.shape[0], dtype=np.uint64)
    table.span_fingerprints(tokens, starts, ends, np.uint64((1 << fingerprint_bits) - 1), fingerprints)
    spans = map(slice, (4 * starts).tolist(), (4 * ends).tolist())
    verifications = np.fromiter(  # maps, not a generator: less per chunk (a rebuild hashes millions)
        map(xxhash.xxh3_64_intdigest, map(memoryview(tokens.data).cast("B").__getitem__, spans)),
        dtype=np.uint64,
        count=starts.shape[0],
    )
    return ChunkContents(
        fingerprints=fingerprints,
        verifications=verifications,
        lengths=lengths.astype(np.uint16),
        fingerprint_bits=fingerprint_bits,
    )


def sequence_chunk_ends(num_tokens: int, chunk_size: int, chunk_ends: Sequence[int] | None) -> npt.NDArray[np.int64]:
    """Each chunk's end in a sequence of ``num_tokens``: ``chunk_ends`` checked, or every ``chunk_size`` tokens."""
    if chunk_ends is None:
        return np.minimum(np.arange(1, num_chunks(num_tokens, chunk_size) + 1, dtype=np.int64) * chunk_size, num_tokens)
    ends = np.asarray(chunk_ends, dtype=np.int64)
    lengths = np.diff(ends, prepend=0) if ends.ndim == 1 else ends
    if (
        ends.ndim != 1
        or (ends.size == 0) != (num_tokens == 0)
        or (ends.size and (int(ends[-1]) != num_tokens or int(lengths.min()) < 1 or int(lengths.max()) > chunk_size))
    ):
        raise InvalidInputError(
            f"chunk_ends must rise to len(tokens)={num_tokens} in steps of 1 to chunk_size={chunk_size} tokens "
            "(kvstore.keys.chunk_bounds)"
        )
    return ends


def check_chunk_size(chunk_size: int) -> None:
    """Refuse a chunk size an index cannot hold (lengths are u16)."""
    if not 1 <= chunk_size <= MAX_CHUNK_TOKENS:
        raise ConfigError(f"chunk_size={chunk_size} must lie in [1, {MAX_CHUNK_TOKENS}] tokens, e.g. 256")
