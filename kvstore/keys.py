"""Prefix-chained chunk keys: equal keys mean equal tokens from position 0 under the same layout.

``key_i = xxh3_128(key_{i-1} || tokens of chunk i)`` with ``key_{-1}`` = the layout's namespace. Tokens are hashed
as little-endian uint32, so a key depends only on token values, never on the caller's integer type, the process,
the machine or Python's hash seed. The last chunk of a sequence may be partial; its key hashes its shorter bytes, so
it never equals the key of a full chunk.

Pure functions, thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NewType

import numpy as np
import numpy.typing as npt
import xxhash

from kvstore.errors import ConfigError, InvalidInputError
from kvstore.layout import Namespace

__all__ = [
    "KEY_BYTES",
    "PrefixKey",
    "TokenArray",
    "as_token_array",
    "chained_key",
    "checked_keys",
    "key_from_hex",
    "num_chunks",
    "prefix_keys",
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


def prefix_keys(namespace: Namespace, tokens: TokenArray, chunk_size: int) -> list[PrefixKey]:
    """Key of every chunk of ``tokens`` (the last one may be partial).

    Args:
        namespace: the layout's namespace (seed of the chain).
        tokens: ids from ``as_token_array``.
        chunk_size: tokens per chunk.

    Returns:
        One 16-byte key per chunk, in order.
    """
    if chunk_size <= 0:
        raise ConfigError(f"chunk_size={chunk_size} must be a positive number of tokens, e.g. 256")
    data = memoryview(tokens.astype("<u4", copy=False).tobytes())
    step = chunk_size * 4
    keys: list[PrefixKey] = []
    previous: bytes = namespace
    for offset in range(0, len(data), step):
        previous = _chain(previous, data[offset : offset + step])
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


def key_from_hex(text: str) -> PrefixKey:
    """Parse a key printed by ``kvstore inspect`` (32 hex digits)."""
    try:
        raw = bytes.fromhex(text.strip())
    except ValueError:
        raw = b""
    if len(raw) != KEY_BYTES:
        raise ConfigError(
            f"chunk key {text!r} is not {2 * KEY_BYTES} hex digits; copy it from `kvstore inspect`"
        )
    return PrefixKey(raw)
