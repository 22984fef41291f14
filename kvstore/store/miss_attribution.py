"""Which reason each miss gets: a lookup's misses are the ranges of the prompt no segment covers, each under the
reason its chunk was not found (the reasons themselves, ``MissReason``, live in ``kvstore.misses``).

Each gap is cut at the prompt's chunk bounds and at the ends of the gone content matches below, and every piece
gets its reason, in this order:

1. a content match this lookup found pointing at a gone chunk covers the piece: ``two_strike`` when this lookup
   removed the entry, else the tier that dropped the chunk it pointed at (``evicted``: beyond the ghost table);
2. the prompt's own chunk is resident, but the lookup stopped before it (a gap without segmented prefix):
   ``behind_gap``;
3. a tier dropped the prompt's chunk (the ghost table): ``evicted_<tier>``;
4. otherwise ``never_stored``.

Adjacent pieces with one reason merge, so a cold prompt is one miss.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.keys import PrefixKey
from kvstore.misses import Miss, MissReason, evicted_from
from kvstore.plan import Segment, gaps_between
from kvstore.tiers.base import TierName

__all__ = ["GoneMatch", "gone_match_reason", "lookup_misses", "retrieve_misses"]


@dataclass(frozen=True, slots=True)
class GoneMatch:
    """A content match whose chunk had left every tier: the query range it covered and why it was not used."""

    start: int
    end: int
    reason: MissReason


def gone_match_reason(dropped_by: TierName | None, *, removed: bool) -> MissReason:
    """The reason of a content match whose chunk is gone (``removed``: its index entry was just struck out)."""
    if removed:
        return MissReason.TWO_STRIKE
    return evicted_from(dropped_by) if dropped_by is not None else MissReason.EVICTED


def lookup_misses(
    segments: Sequence[Segment],
    bounds: Sequence[int],
    keys: Sequence[PrefixKey],
    *,
    is_resident: Callable[[PrefixKey], bool],
    dropped_by: Callable[[PrefixKey], TierName | None],
    gone: Sequence[GoneMatch] = (),
) -> tuple[Miss, ...]:
    """The misses that, with ``segments``, tile ``[0, bounds[-1])`` (see the module docstring for the reasons).

    Args:
        segments: the plan's segments, sorted and non-overlapping.
        bounds: the prompt's chunk bounds (``bounds[-1]`` is its length).
        keys: the prompt's prefix key of each chunk.
        is_resident: whether some tier holds a chunk.
        dropped_by: the ghost table's answer for a chunk.
        gone: the content matches the lookup found gone.
    """
    cuts = sorted({*bounds, *(match.start for match in gone), *(match.end for match in gone)})
    misses: list[Miss] = []
    for gap in gaps_between(tuple(segments), bounds[-1]):
        cursor = gap.start
        while cursor < gap.end:
            end = min(gap.end, cuts[bisect.bisect_right(cuts, cursor)])
            key = keys[bisect.bisect_right(bounds, cursor) - 1]
            _append_merged(misses, Miss(cursor, end, _piece_reason(cursor, key, gone, is_resident, dropped_by)))
            cursor = end
    return tuple(misses)


def _append_merged(misses: list[Miss], miss: Miss) -> None:
    """Append ``miss``, merged into the last one when it continues it with the same reason."""
    if misses and misses[-1].end == miss.start and misses[-1].reason is miss.reason:
        misses[-1] = Miss(misses[-1].start, miss.end, miss.reason)
    else:
        misses.append(miss)


def _piece_reason(
    start: int,
    key: PrefixKey,
    gone: Sequence[GoneMatch],
    is_resident: Callable[[PrefixKey], bool],
    dropped_by: Callable[[PrefixKey], TierName | None],
) -> MissReason:
    for match in gone:
        if match.start <= start < match.end:
            return match.reason
    if is_resident(key):
        return MissReason.BEHIND_GAP
    tier = dropped_by(key)
    return evicted_from(tier) if tier is not None else MissReason.NEVER_STORED


def retrieve_misses(planned: Sequence[Miss], dropped: Sequence[Miss], start: int) -> tuple[Miss, ...]:
    """A retrieve's misses from ``start`` on: the plan's, and the planned segments it could not serve, in order."""
    clipped = [Miss(max(miss.start, start), miss.end, miss.reason) for miss in (*planned, *dropped) if miss.end > start]
    merged: list[Miss] = []
    for miss in sorted(clipped, key=lambda miss: miss.start):
        _append_merged(merged, miss)
    return tuple(merged)
