"""Content-defined chunk boundaries over token ids: where a run of tokens is cut when the store's rule is ``content``.

A position ``p`` (the boundary between tokens ``p - 1`` and ``p``) is a *candidate* when a hash of the
``window_tokens`` ids before it is a multiple of ``divisor``; it is a *content cut* when it is a candidate, lies at
least ``min_tokens`` into the run, and no other candidate lies in the ``min_tokens - 1`` positions before it. Then
chunks end at the content cuts, and a run with no content cut for ``max_tokens`` (``chunk_size``) tokens is cut
there (a *forced* cut, counted from the cut before it)::

    tokens:    ... other text | document d0 d1 d2 ............................................ |
    candidate:        x     x |    x           x        x   x                 x
    content cut:      ^       |                ^        ^                     ^
                                ^ sync_tokens: from here on a cut's decision reads only the document

Why this rule (docs/design-notes.md#content-defined-chunks):

* **Local**: whether ``p`` is a content cut reads only the ``window_tokens + min_tokens - 1`` tokens before it
  (``ContentCutShape.sync_tokens``), never where the previous chunk ended. So the same document after any other
  tokens has the same content cuts from ``sync_tokens`` into it on, and from the first of them every boundary
  (forced ones too) is the same: the two prompts share every chunk after it.
* **Prefix-stable**: a boundary depends only on tokens before it, so the boundaries of a prefix of a sequence are the
  sequence's boundaries below the prefix's length, then its length: a store of the first ``n`` tokens cuts them as a
  store of the whole sequence does (exact prefix hits stay exact; an engine may store a prompt in pieces).
* **Bounded**: every chunk holds at most ``max_tokens``, what every tier already sizes a chunk by; a chunk between
  two content cuts holds at least ``min_tokens``. A chunk may be shorter when it is a run's last, or follows a forced
  cut (a content cut may land just after one).

The hash mixes each token id (a multiply and xor-shift), combines the window as a polynomial and finalises it
(splitmix64's finaliser), all on uint64 arrays that wrap mod 2**64: equal ids give equal cuts on every machine.

Pure functions; thread-safe.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvstore.chunking import ContentCutShape

__all__ = ["content_bounds", "content_cuts"]

_TOKEN_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)
_WINDOW_BASE = np.uint64(0x100000001B3)
_FINAL_MULTIPLIERS = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def _mixed_tokens(tokens: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint64]:
    """Each token id spread over 64 bits, so nearby ids do not give nearby window hashes."""
    mixed = tokens.astype(np.uint64) * _TOKEN_MULTIPLIER
    mixed ^= mixed >> np.uint64(32)
    return mixed


def _window_hashes(tokens: npt.NDArray[np.uint32], window_tokens: int) -> npt.NDArray[np.uint64]:
    """Entry ``i``: the hash of ``tokens[i:i + window_tokens]``, for every position ``i + window_tokens < len``.

    The window's polynomial ``sum(mixed[i + j] * BASE**(window - 1 - j))`` is built by doubling when the window is a
    power of two (``h_2k(i) = h_k(i) * BASE**k + h_k(i + k)``: 4 passes for 16 tokens instead of 16), else term by
    term; both give the same values.
    """
    mixed = _mixed_tokens(tokens)
    count = tokens.shape[0] - window_tokens
    if window_tokens & (window_tokens - 1) == 0:
        hashes = mixed
        width, weight = 1, int(_WINDOW_BASE)
        while width < window_tokens:
            hashes = hashes[:-width] * np.uint64(weight) + hashes[width:]
            width, weight = 2 * width, weight * weight % 2**64
        hashes = hashes[:count].copy()
    else:
        hashes = np.zeros(count, dtype=np.uint64)
        for offset in range(window_tokens):
            np.multiply(hashes, _WINDOW_BASE, out=hashes)
            np.add(hashes, mixed[offset : offset + count], out=hashes)
    for multiplier in _FINAL_MULTIPLIERS:
        hashes ^= hashes >> np.uint64(31)
        np.multiply(hashes, multiplier, out=hashes)
    hashes ^= hashes >> np.uint64(29)
    return hashes


def _candidates(hashes: npt.NDArray[np.uint64], divisor: int) -> npt.NDArray[np.bool_]:
    """Which hashes are multiples of ``divisor`` (a mask when it is a power of two: the same answer, no division)."""
    remainders = hashes & np.uint64(divisor - 1) if divisor & (divisor - 1) == 0 else hashes % np.uint64(divisor)
    candidates: npt.NDArray[np.bool_] = remainders == 0
    return candidates


def content_cuts(tokens: npt.NDArray[np.uint32], shape: ContentCutShape) -> npt.NDArray[np.int64]:
    """The content cuts of one run (positions in ``[min_tokens, len(tokens))``, increasing; see the module docstring).

    Args:
        tokens: the run's token ids, ``tokens[0]`` its first (a sequence's start or a separator run's).
        shape: the sizes (``ContentCutShape.for_chunk_size``).
    """
    window = shape.window_tokens
    if tokens.shape[0] <= max(window, shape.min_tokens):
        return np.empty(0, dtype=np.int64)
    hashes = _window_hashes(tokens, window)
    candidates = np.flatnonzero(_candidates(hashes, shape.divisor)).astype(np.int64) + window
    if candidates.shape[0] == 0:
        return candidates
    gaps = np.diff(candidates, prepend=np.int64(-shape.min_tokens))
    return candidates[(gaps >= shape.min_tokens) & (candidates >= shape.min_tokens)]


def content_bounds(tokens: npt.NDArray[np.uint32], shape: ContentCutShape) -> list[int]:
    """Where the chunks of one run start, then ``len(tokens)``: its content cuts, with a forced cut wherever
    ``max_tokens`` pass without one (counted from the boundary before)."""
    num_tokens = int(tokens.shape[0])
    if not num_tokens:
        return [0]
    longest = shape.max_tokens
    bounds = [0]
    last = 0
    for cut in [*content_cuts(tokens, shape).tolist(), num_tokens]:
        while cut - last > longest:
            last += longest
            bounds.append(last)
        bounds.append(cut)
        last = cut
    return bounds
