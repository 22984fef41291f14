"""Content fingerprints: a 64-bit polynomial hash of a token window, computed block-wise or rolling.

``fingerprint(t[0..n)) = sum(t[i] * BASE**(n-1-i)) mod 2**64`` over uint32 token ids. The same function is
computed three ways, which must agree bit for bit (``tests/content/test_index.py`` checks it):

* ``block_fingerprints``: one fingerprint per non-overlapping chunk, the last one possibly partial (registration);
* ``rolling_fingerprints``: the fingerprint of every window of ``window_tokens`` tokens (tests, tools);
* ``kvstore.content.index``'s probe kernel, which rolls the same recurrence inline and looks each window up.

Polynomial hashing mod 2**64 is not collision-resistant (Thue-Morse strings collide), so a fingerprint only
nominates candidates; the index proves every hit with an independent xxh3_64 of the tokens.

Pure functions over their arguments; numba kernels release the GIL (``nogil=True``), so they are thread-safe.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit

from kvstore.errors import ConfigError
from kvstore.keys import TokenArray

__all__ = ["FINGERPRINT_BASE", "block_fingerprints", "rolling_fingerprints", "window_base_power"]

FINGERPRINT_BASE = np.uint64(0x100000001B3)
"""Odd multiplier of the polynomial (the 64-bit FNV prime): odd, so it is invertible mod 2**64."""


@njit(cache=True, nogil=True)
def _power(base: np.uint64, exponent: int) -> np.uint64:
    result = np.uint64(1)
    for _ in range(exponent):
        result = result * base
    return result


def window_base_power(window_tokens: int) -> np.uint64:
    """``BASE**(window_tokens-1) mod 2**64``: the weight of the token leaving a rolling window."""
    return np.uint64(_power(FINGERPRINT_BASE, window_tokens - 1))


@njit(cache=True, nogil=True)
def _block_kernel(tokens: npt.NDArray[np.uint32], chunk_tokens: int, out: npt.NDArray[np.uint64]) -> None:
    base = np.uint64(0x100000001B3)
    for chunk_idx in range(out.shape[0]):
        start = chunk_idx * chunk_tokens
        stop = min(start + chunk_tokens, tokens.shape[0])
        value = np.uint64(0)
        for position in range(start, stop):
            value = value * base + np.uint64(tokens[position])
        out[chunk_idx] = value


@njit(cache=True, nogil=True)
def _rolling_kernel(
    tokens: npt.NDArray[np.uint32], window_tokens: int, leaving_weight: np.uint64, out: npt.NDArray[np.uint64]
) -> None:
    base = np.uint64(0x100000001B3)
    value = np.uint64(0)
    for position in range(window_tokens):
        value = value * base + np.uint64(tokens[position])
    for start in range(out.shape[0]):
        out[start] = value
        if start + window_tokens < tokens.shape[0]:
            value = (value - np.uint64(tokens[start]) * leaving_weight) * base + np.uint64(
                tokens[start + window_tokens]
            )


def _check_window(window_tokens: int) -> None:
    if window_tokens <= 0:
        raise ConfigError(f"chunk_size={window_tokens} must be a positive number of tokens, e.g. 256")


def block_fingerprints(tokens: TokenArray, chunk_tokens: int) -> npt.NDArray[np.uint64]:
    """Fingerprint of each chunk of ``tokens`` cut from position 0; the last chunk may be partial.

    Args:
        tokens: uint32 token ids (``kvstore.keys.as_token_array``).
        chunk_tokens: tokens per chunk.

    Returns:
        One uint64 fingerprint per chunk (``ceil(len(tokens) / chunk_tokens)`` of them).
    """
    _check_window(chunk_tokens)
    out = np.empty(-(-tokens.shape[0] // chunk_tokens), dtype=np.uint64)
    if out.size:
        _block_kernel(tokens, chunk_tokens, out)
    return out


def rolling_fingerprints(tokens: TokenArray, window_tokens: int) -> npt.NDArray[np.uint64]:
    """Fingerprint of every window of ``window_tokens`` consecutive tokens (entry i covers ``[i, i+window)``).

    Args:
        tokens: uint32 token ids.
        window_tokens: window length in tokens.

    Returns:
        ``max(0, len(tokens) - window_tokens + 1)`` uint64 fingerprints.
    """
    _check_window(window_tokens)
    out = np.empty(max(0, tokens.shape[0] - window_tokens + 1), dtype=np.uint64)
    if out.size:
        _rolling_kernel(tokens, window_tokens, window_base_power(window_tokens), out)
    return out
