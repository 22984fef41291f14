"""Prefix-chained chunk keys: equal keys mean equal tokens from position 0 under the same layout.

``key_i = xxh3_128(key_{i-1} || tokens of chunk i)`` with ``key_{-1}`` = the layout's namespace. Tokens are hashed
as little-endian uint32, so a key depends only on token values, never on the caller's integer type, the process,
the machine or Python's hash seed. The last chunk of a sequence may be partial; its key hashes its shorter bytes, so
it never equals the key of a full chunk.

Chunk boundaries fall every ``chunk_size`` tokens from position 0 and, when the store names a *separator* (a token
sequence such as a RAG template's document delimiter), restart right after each occurrence of it
(``chunk_bounds``)::

    tokens:  | system  SEP | doc A ... (chunk_size) | doc A tail  SEP | doc B  SEP | question |
    bounds:  0             ^                        ^                 ^            ^          ^ len

so a document's chunks cover its own tokens whatever precedes it, and the content index finds it in any prompt that
puts the same separator before it. Under the ``content`` rule (``kvstore.chunking``) each run is cut where its
tokens say instead (``kvstore.content_cut``), so a document is cut the same way wherever it sits, separator or not.
Boundaries depend only on the tokens before them, so equal prefixes still get equal keys, and a key still names one
token sequence and one cut of it (the chain hashes each chunk's bytes in turn). ``chunk_bounds`` is the one function
every part of the store cuts with (store, lookup, the server's parts), so no two of them can disagree.

Pure functions, thread-safe.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NewType

import numpy as np
import numpy.typing as npt
import xxhash

from kvstore.chunking import Chunking, ContentCutShape
from kvstore.content_cut import content_bounds
from kvstore.errors import ConfigError, InvalidInputError
from kvstore.layout import Namespace

__all__ = [
    "KEY_BYTES",
    "PrefixKey",
    "TokenArray",
    "as_token_array",
    "chained_key",
    "checked_keys",
    "chunk_bounds",
    "key_from_hex",
    "key_words",
    "keys_at_bounds",
    "num_chunks",
    "prefix_keys",
    "separator_run_starts",
]

PrefixKey = NewType("PrefixKey", bytes)
"""16-byte prefix-chained chunk key."""

TokenArray = npt.NDArray[np.uint32]

KEY_BYTES = 16
_MAX_TOKEN_ID = 2**32 - 1


def as_token_array(tokens: Sequence[int] | npt.NDArray[np.integer]) -> TokenArray:
    """Validate token ids and return them as a contiguous little-endian uint32 array.

    Raises:
        InvalidInputError: the ids are not one-dimensional integers in [0, 2**32).
    """
    if isinstance(tokens, np.ndarray):
        array = tokens
    else:
        try:
            array = np.asarray(tokens)
        except (ValueError, TypeError) as exc:
            raise InvalidInputError(f"tokens must be a 1-D sequence of integer ids: {exc}") from exc
    if array.ndim != 1:
        raise InvalidInputError(f"tokens must be 1-D, got shape {list(array.shape)}")
    if array.size == 0:
        return np.empty(0, dtype="<u4")
    if array.dtype.kind not in "iu":
        raise InvalidInputError(f"token ids must be integers, got dtype {array.dtype}")
    if (array.dtype.kind == "i" and int(array.min()) < 0) or int(array.max()) > _MAX_TOKEN_ID:
        raise InvalidInputError(
            f"token ids must lie in [0, 2**32), got min {int(array.min())} and max {int(array.max())}"
        )
    return np.ascontiguousarray(array, dtype="<u4")


def num_chunks(num_tokens: int, chunk_size: int) -> int:
    """Chunks needed for ``num_tokens`` tokens, the last one possibly partial."""
    return -(-num_tokens // chunk_size)


def separator_run_starts(tokens: TokenArray, separator: Sequence[int]) -> list[int]:
    """Position 0 and the position right after each occurrence of ``separator`` (left to right, occurrences not
    overlapping, as ``str.split`` finds them) that leaves tokens after it: where the runs of ``tokens`` start."""
    starts = [0]
    width = len(separator)
    if not width or tokens.shape[0] < width:
        return starts
    pattern = np.asarray(separator, dtype="<u4")
    span = tokens.shape[0] - width + 1
    found = tokens[:span] == pattern[0]
    for offset in range(1, width):
        found &= tokens[offset : offset + span] == pattern[offset]
    after = -1
    for position in np.flatnonzero(found).tolist():
        if position >= after:
            after = position + width
            if after < tokens.shape[0]:
                starts.append(after)
    return starts


def chunk_bounds(
    tokens: TokenArray, chunk_size: int, separator: Sequence[int] = (), chunking: Chunking = Chunking.FIXED
) -> list[int]:
    """Where the chunks of ``tokens`` start, followed by ``len(tokens)``: chunk ``i`` is ``[b[i], b[i + 1])``.

    Each separator run is cut on its own (see the module docstring): ``fixed``, every ``chunk_size`` tokens from
    the run's start (without a separator ``0, chunk_size, 2 * chunk_size, ...``); ``content``, at the run's content
    cuts (``kvstore.content_cut``), no chunk longer than ``chunk_size``. Either way the boundaries below ``n`` of
    ``tokens[:n]`` are those of ``tokens``.

    Raises:
        ConfigError: ``chunk_size`` is not positive (or below 16 for ``content``).
    """
    if chunk_size <= 0:
        raise ConfigError(f"chunk_size={chunk_size} must be a positive number of tokens, e.g. 256")
    shape = ContentCutShape.for_chunk_size(chunk_size) if chunking == Chunking.CONTENT else None
    num_tokens = int(tokens.shape[0])
    run_starts = separator_run_starts(tokens, separator)
    bounds: list[int] = []
    for run_start, run_end in zip(run_starts, [*run_starts[1:], num_tokens], strict=True):
        if shape is None:
            bounds.extend(range(run_start, run_end, chunk_size))
        else:
            bounds.extend(run_start + bound for bound in content_bounds(tokens[run_start:run_end], shape)[:-1])
    bounds.append(num_tokens)
    return bounds if num_tokens else [0]


def prefix_keys(
    namespace: Namespace,
    tokens: TokenArray,
    chunk_size: int,
    separator: Sequence[int] = (),
    chunking: Chunking = Chunking.FIXED,
) -> list[PrefixKey]:
    """Key of every chunk of ``tokens`` cut at ``chunk_bounds(tokens, chunk_size, separator, chunking)``.

    Args:
        namespace: the layout's namespace (seed of the chain).
        tokens: ids from ``as_token_array``.
        chunk_size: tokens per chunk (the longest chunk under ``content``).
        separator: token ids after which a chunk restarts (none: one run).
        chunking: the cut rule.

    Returns:
        One 16-byte key per chunk, in order.
    """
    return keys_at_bounds(namespace, tokens, chunk_bounds(tokens, chunk_size, separator, chunking))


def keys_at_bounds(namespace: Namespace, tokens: TokenArray, bounds: Sequence[int]) -> list[PrefixKey]:
    """``prefix_keys`` of the chunks ``[bounds[i], bounds[i + 1])`` (``chunk_bounds``' list, already computed)."""
    data = memoryview(tokens.astype("<u4", copy=False).tobytes())
    keys: list[PrefixKey] = []
    previous: bytes = namespace
    for start, end in itertools.pairwise(bounds):
        previous = _chain(previous, data[4 * start : 4 * end])
        keys.append(PrefixKey(previous))
    return keys


def chained_key(previous: bytes, chunk_tokens: TokenArray) -> PrefixKey:
    """Key of a chunk following the chunk keyed ``previous`` (or the namespace, for chunk 0).

    Lets a lookup test whether a stored chunk of any length (a partial last chunk included) is exact at a prompt
    position: its key equals the prompt's chain extended by the same tokens.
    """
    return PrefixKey(_chain(previous, memoryview(chunk_tokens.astype("<u4", copy=False).tobytes())))


def _chain(previous: bytes, chunk_bytes: memoryview) -> bytes:
    return xxhash.xxh3_128_digest(previous + chunk_bytes)


def checked_keys(keys: Sequence[object]) -> list[PrefixKey]:
    """``keys`` as chunk keys, each checked to be ``KEY_BYTES`` bytes (a key of any other length names nothing
    and would silently evict nothing).

    Raises:
        InvalidInputError: a key that is not ``KEY_BYTES`` bytes, naming its position.
    """
    checked = []
    for position, key in enumerate(keys):
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise InvalidInputError(
                f"keys[{position}] is not a {KEY_BYTES}-byte chunk key ({type(key).__name__} of length "
                f"{len(key) if isinstance(key, bytes) else '-'}); pass keys from a plan or key_from_hex"
            )
        checked.append(PrefixKey(key))
    return checked


def key_words(keys: Sequence[bytes]) -> npt.NDArray[np.uint64]:
    """16-byte keys as rows of two little-endian u64 words: how arrays of keys are compared, sorted and stored."""
    return np.frombuffer(b"".join(keys), dtype="<u8").reshape(len(keys), 2)


def key_from_hex(text: str) -> PrefixKey:
    """Parse a key printed by ``kvstore inspect`` (32 hex digits)."""
    try:
        raw = bytes.fromhex(text.strip())
    except ValueError:
        raw = b""
    if len(raw) != KEY_BYTES:
        raise ConfigError(f"chunk key {text!r} is not {2 * KEY_BYTES} hex digits; copy it from `kvstore inspect`")
    return PrefixKey(raw)
