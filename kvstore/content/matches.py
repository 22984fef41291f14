"""What the content index answers: a verified match of a stored chunk in a query, a registration's outcome, and
how lists of matches combine (which positions they cover; leftmost first without overlap).

Threads: immutable values and pure functions.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvstore.keys import KEY_BYTES, PrefixKey

__all__ = ["Alias", "Match", "MatchCoverage", "RegistrationResult", "leftmost_without_overlap", "match_at"]


class Match(NamedTuple):
    """A verified occurrence of a stored chunk in a query.

    A named tuple rather than a frozen dataclass: a match of a 15k-token prompt makes ~60 of them, and a tuple is built
    several times faster; as dataclasses they were a sizeable share of the whole match (measured:
    docs/design-notes.md#content-index).

    Attributes:
        query_start: token position of the chunk in the query.
        num_tokens: chunk length in tokens (``chunk_size``, or less for a sequence's last chunk).
        key: prefix key of the stored chunk.
        source_start: token position of the chunk in the sequence it was stored with.
    """

    query_start: int
    num_tokens: int
    key: PrefixKey
    source_start: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Alias:
    """A chunk whose content was already indexed under another key (dedup-content: first writer wins)."""

    key: PrefixKey
    existing_key: PrefixKey


@dataclass(frozen=True, slots=True, kw_only=True)
class RegistrationResult:
    """What ``FingerprintIndex.register`` did with each chunk.

    Attributes:
        num_added: chunks that became new entries.
        num_already_indexed: chunks whose key already indexed the same content (re-registration).
        aliases: chunks indexed under a different key with equal content; the store records them as aliases.
    """

    num_added: int
    num_already_indexed: int
    aliases: tuple[Alias, ...]


class MatchCoverage:
    """Which query positions a list of non-overlapping matches covers (bisect over their starts)."""

    def __init__(self, matches: Sequence[Match]) -> None:
        ordered = sorted(matches, key=lambda found: found.query_start)
        self._starts = [found.query_start for found in ordered]
        self._ends = [found.query_start + found.num_tokens for found in ordered]

    def holds(self, position: int) -> bool:
        index = bisect.bisect_right(self._starts, position)
        return index > 0 and self._ends[index - 1] > position


def leftmost_without_overlap(matches: Sequence[Match]) -> list[Match]:
    """The matches sorted by query start, each kept only if it starts past every kept one's end (each match is
    verified on its own, so dropping an overlapping chunk never invalidates the rest of its chain)."""
    kept: list[Match] = []
    cursor = 0
    for found in sorted(matches, key=lambda found: found.query_start):
        if found.query_start >= cursor:
            kept.append(found)
            cursor = found.query_start + found.num_tokens
    return kept


def match_at(key_bytes: bytes, position: int, query_start: int, num_tokens: int, source_start: int) -> Match:
    """The match of the ``position``-th planned entry, whose key is the ``position``-th 16 bytes of ``key_bytes``."""
    key = PrefixKey(key_bytes[KEY_BYTES * position : KEY_BYTES * (position + 1)])
    return Match(query_start=query_start, num_tokens=num_tokens, key=key, source_start=source_start)
