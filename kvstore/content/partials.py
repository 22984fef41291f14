"""Partial matches: the stretch of a stored chunk a query holds token for token where the whole chunk does not match.

Content matches (``FingerprintIndex.match``) find stored chunks whole. Around them a document loses two pieces when
it was stored in other surroundings than the query's::

    stored:  | template + doc head | doc c1 | ... | doc c7 | doc tail + question ... |
    query:   | previous doc tail + doc head | doc c1 | ... | doc c7 | doc tail + next doc ... |
                          ^^^^^^^^ HEAD                                ^^^^^^^^ TAIL

- **TAIL**: after a matched chunk (an *anchor*) whose stored successor differs from what follows it in the query,
  the common token *prefix* of that successor and the query's following tokens: rows ``[0, n)`` of the successor.
- **HEAD**: before an anchor whose stored predecessor differs from what precedes it in the query, the common token
  *suffix* of that predecessor and the query's preceding tokens: its last ``n`` rows.

The first tokens that differ (BPE merged a document's first or last token with its neighbour differently) are not
part of the stretch: the engine computes them. A stretch never overlaps an anchor or another stretch; TAILs are
placed first, then HEADs in what is left. The KV of a stretch was computed at the stored chunk's positions, after the
stored chunk's own preceding tokens, like any content hit: the engine re-rotates and blends it (or uses it as is
when it continues an exact prefix at its own positions: the store decides, it knows which anchors are exact).

Neighbours come from the index's ``next`` and ``prev`` links (one registered sequence's chunks, first writer wins);
the index keeps no tokens, so the stored chunk's tokens come from its owner (``stored_tokens``: the store reads the
chunk's record from the tier holding it). This module is the arithmetic: which stretch, given the tokens.

Pure functions and values; thread-safe.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from kvstore.keys import PrefixKey, TokenArray

__all__ = [
    "MIN_PARTIAL_TOKENS",
    "Anchor",
    "Neighbour",
    "PartialMatch",
    "StoredTokens",
    "common_prefix_length",
    "common_suffix_length",
    "plan_partials",
]

MIN_PARTIAL_TOKENS = 16
"""The shortest stretch worth a segment. Below it: (1) what it saves, at most 15 tokens' prefill (85% of it at the
default recompute ratio), is of the order of what it costs, a pin, a record read at lookup, one more copy at
retrieve (a disk chunk decoded whole for a few of its rows) and one more reused span whose first tokens the blend
recomputes anyway (``chunk_start_tokens``); (2) short common stretches occur by chance between unrelated texts (a
blank line and a capital, a chat template's markers), and their KV was computed in another context; (3) it is
vLLM's block size, the unit an engine's KV moves in."""

StoredTokens = Callable[[PrefixKey], TokenArray | None]
"""The token ids of a stored chunk, ``None`` when no tier the caller can read holds it (then it is not sliced)."""


class Anchor(NamedTuple):
    """A planned range of the query whose stored chunk's neighbours may continue it (a match, an exact segment)."""

    query_start: int
    num_tokens: int
    key: PrefixKey

    @property
    def end(self) -> int:
        return self.query_start + self.num_tokens


class Neighbour(NamedTuple):
    """A stored chunk next to an anchor's in its registered sequence: its key, its position there, its length."""

    key: PrefixKey
    source_start: int
    num_tokens: int


class PartialMatch(NamedTuple):
    """A stretch of a stored chunk found in the query token for token.

    Attributes:
        query_start: position of the stretch's first token in the query.
        num_tokens: tokens in the stretch.
        key: the stored chunk's key.
        source_start: position of the stretch's first token in the sequence the chunk was stored with (the chunk's
            start plus ``offset``).
        offset: rows of the stored chunk before the stretch (0 for a TAIL).
        chunk_tokens: the stored chunk's length.
        anchor_key: the key of the anchor whose neighbour the chunk is.
        follows: the stretch continues its anchor (a TAIL); ``False``: it leads into it (a HEAD).
    """

    query_start: int
    num_tokens: int
    key: PrefixKey
    source_start: int
    offset: int
    chunk_tokens: int
    anchor_key: PrefixKey
    follows: bool

    @property
    def end(self) -> int:
        return self.query_start + self.num_tokens


def common_prefix_length(left: TokenArray, right: TokenArray) -> int:
    """How many leading tokens the two arrays share."""
    length = min(left.shape[0], right.shape[0])
    differ = np.flatnonzero(left[:length] != right[:length])
    return int(differ[0]) if differ.shape[0] else length


def common_suffix_length(left: TokenArray, right: TokenArray) -> int:
    """How many trailing tokens the two arrays share."""
    return common_prefix_length(left[::-1], right[::-1])


class _Covered:
    """The query ranges taken so far (anchors and placed stretches), sorted and disjoint."""

    def __init__(self, ranges: Sequence[tuple[int, int]]) -> None:
        self._ranges = sorted(ranges)

    def add(self, start: int, end: int) -> None:
        bisect.insort(self._ranges, (start, end))

    def free_end(self, position: int, limit: int) -> int:
        """The end of the free run starting at ``position`` (``position`` itself when it is taken), at most
        ``limit``."""
        index = bisect.bisect_right(self._ranges, (position, 2**62))
        if index and self._ranges[index - 1][1] > position:
            return position
        return min(limit, self._ranges[index][0]) if index < len(self._ranges) else limit

    def free_start(self, position: int) -> int:
        """The start of the free run ending at ``position`` (``position`` itself when ``position - 1`` is taken)."""
        index = bisect.bisect_left(self._ranges, (position, -1))
        if index and self._ranges[index - 1][1] >= position:
            return position
        return self._ranges[index - 1][1] if index else 0


def plan_partials(
    query: TokenArray,
    anchors: Sequence[Anchor],
    neighbours_of: Callable[[PrefixKey], tuple[Neighbour | None, Neighbour | None]],
    stored_tokens: StoredTokens,
    *,
    min_tokens: int = MIN_PARTIAL_TOKENS,
) -> list[PartialMatch]:
    """The TAIL and HEAD stretches around ``anchors`` (see the module docstring), sorted by query start.

    A neighbour the query holds whole is taken whole (whatever its length) and its own neighbour tried next: the
    stored chunks of a document's head may be cut otherwise than the query's before the cuts re-synchronise, so
    several of them can precede the first chunk the query's cut shares.

    Args:
        query: the prompt's token ids.
        anchors: the ranges already planned, sorted and disjoint.
        neighbours_of: a stored chunk's ``(predecessor, successor)``, ``None`` where there is none.
        stored_tokens: a stored chunk's tokens; a chunk whose tokens are unknown or not as long as the index says
            is left out.
        min_tokens: the shortest stretch of a chunk kept when it is not the whole chunk.
    """
    num_tokens = query.shape[0]
    ends = [anchor.end for anchor in anchors]
    starts = [anchor.query_start for anchor in anchors]
    # only the anchors beside a gap can have a stretch: a prompt its plan covers whole costs this pass and no more
    tails = [anchor for anchor, end, after in zip(anchors, ends, [*starts[1:], num_tokens], strict=True) if end < after]
    heads = [anchor for anchor, start, before in zip(anchors, starts, [0, *ends[:-1]], strict=True) if start > before]
    if not tails and not heads:
        return []
    covered = _Covered(list(zip(starts, ends, strict=True)))
    found: list[PartialMatch] = []

    def tokens_of(neighbour: Neighbour) -> TokenArray | None:
        tokens = stored_tokens(neighbour.key)
        return tokens if tokens is not None and tokens.shape[0] == neighbour.num_tokens else None

    def kept(length: int, neighbour: Neighbour) -> bool:
        return length >= min_tokens or (length > 0 and length == neighbour.num_tokens)

    for anchor in tails:  # TAILs: forward from each anchor's end
        position, key = anchor.end, anchor.key
        while covered.free_end(position, num_tokens) > position and (successor := neighbours_of(key)[1]) is not None:
            end = covered.free_end(position, min(num_tokens, position + successor.num_tokens))
            stored = tokens_of(successor)
            length = 0 if stored is None else common_prefix_length(stored, query[position:end])
            if not kept(length, successor):
                break
            found.append(PartialMatch(position, length, successor.key, successor.source_start, 0,
                                      successor.num_tokens, key, True))  # fmt: skip
            covered.add(position, position + length)
            if length < successor.num_tokens:
                break
            position, key = position + length, successor.key
    for anchor in heads:  # HEADs: backward from each anchor's start
        position, key = anchor.query_start, anchor.key
        while covered.free_start(position) < position and (predecessor := neighbours_of(key)[0]) is not None:
            start = max(covered.free_start(position), position - predecessor.num_tokens)
            stored = tokens_of(predecessor)
            length = 0 if stored is None else common_suffix_length(stored, query[start:position])
            if not kept(length, predecessor):
                break
            offset = predecessor.num_tokens - length
            found.append(PartialMatch(position - length, length, predecessor.key, predecessor.source_start + offset,
                                      offset, predecessor.num_tokens, key, False))  # fmt: skip
            covered.add(position - length, position)
            if offset:
                break
            position, key = position - length, predecessor.key
    found.sort(key=lambda partial: partial.query_start)
    return found
