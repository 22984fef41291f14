"""The two legs of a lookup: the prompt's prefix keys (exact segments), then its content anywhere (blend segments).

``TieredStore.lookup`` runs them in order and pins every chunk they plan through ``pin`` (the fastest local tier
holding it, or the name of a shared tier that knows it, unpinned); a chunk ``pin`` cannot place is not planned. The
match leg ends with the slices: next to every planned range, the stretch of a neighbouring stored chunk the prompt
holds token for token (``kvstore.content.partials``).

Pure functions over the catalog and the callback; thread-safe as they are.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

from kvstore.chunking import Chunking
from kvstore.content.catalog import ContentCatalog
from kvstore.content.index import Match
from kvstore.content.partials import Anchor, PartialMatch
from kvstore.keys import PrefixKey, TokenArray, chained_key, separator_run_starts
from kvstore.plan import Segment, gaps_between
from kvstore.tiers.base import TierName

__all__ = ["PinFastest", "match_leg", "prefix_leg"]

PinFastest = Callable[[PrefixKey], TierName | None]
"""Pins a chunk where the lookup will read it and names that tier (``None``: no tier holds it)."""


def prefix_leg(
    keys: Sequence[PrefixKey],
    bounds: Sequence[int],
    pin: PinFastest,
    catalog: ContentCatalog | None,
    *,
    segmented_prefix: bool,
) -> list[Segment]:
    """Exact segments from the prefix keys (and blend segments from dedup aliases, when ``catalog`` is given).

    A missing chunk ends the leg, or with segmented prefix becomes a gap: the chunks after it are still exact,
    because their keys chain over every earlier token of the prompt.
    """
    segments: list[Segment] = []
    for index, key in enumerate(keys):
        start = bounds[index]
        num_tokens = bounds[index + 1] - start
        tier = pin(key)
        if tier is not None:
            segments.append(
                Segment(start=start, num_tokens=num_tokens, key=key, source_start=start, exact=True, tier=tier)
            )
            continue
        aliased = None
        if catalog is not None:
            aliased = catalog.resolve_alias(key, pin)
        if aliased is not None:
            target, tier = aliased
            segments.append(
                Segment(
                    start=start,
                    num_tokens=num_tokens,
                    key=target.key,
                    source_start=target.source_start,
                    exact=False,
                    tier=tier,
                )
            )
            continue
        if not segmented_prefix:
            break
    return segments


def match_leg(
    tokens: TokenArray,
    keys: Sequence[PrefixKey],
    bounds: Sequence[int],
    segments: list[Segment],
    catalog: ContentCatalog,
    pin: PinFastest,
    *,
    namespace: bytes,
    separator: Sequence[int],
    chunking: Chunking,
    on_gone: Callable[[Match, bool], None] | None = None,
    partial: bool = True,
) -> list[Segment]:
    """Add content matches that do not overlap the prefix leg's segments, then (``partial``) the slices around every
    segment; returns all segments sorted (``on_gone``: ``ContentCatalog.match``'s).

    How the prompt is probed follows the store's cut (``bounds``): fixed chunks by every window of ``chunk_size``
    tokens, and where a separator cuts the prompt into runs (or it is shorter than a chunk) by its own chunks' exact
    content too; content-defined chunks by their own content only (the cut follows the tokens, so a stored chunk
    past a document's first few tokens is one of the prompt's chunks, wherever the document sits).
    """
    catalog.sync()
    chunk_index = {bound: index for index, bound in enumerate(bounds[:-1])}
    starts = [segment.start for segment in segments]
    ends = [segment.end for segment in segments]

    def overlaps(found: Match) -> bool:
        position = bisect.bisect_right(starts, found.query_start + found.num_tokens - 1)
        return position > 0 and ends[position - 1] > found.query_start

    content = chunking is Chunking.CONTENT
    grid_bounds: Sequence[int] = ()
    if content:
        # The prefix leg planned its leading run: probe from that run's last chunk on (its chain may continue into a
        # stored partial chunk the prompt's own cut does not make).
        grid_bounds = bounds[max(0, _leading_run_chunks(segments) - 1) :]
    elif _separator_cuts(tokens, separator, catalog.chunk_size):
        grid_bounds = bounds
    matches = catalog.match(
        tokens, grid_bounds=grid_bounds, scan_windows=not content, skip=overlaps, pin=pin, on_gone=on_gone
    )
    for found, tier in matches:
        index = chunk_index.get(found.query_start, -1)
        exact = (
            index >= 0
            and found.source_start == found.query_start
            and found.key
            == chained_key(
                keys[index - 1] if index else namespace,
                tokens[found.query_start : found.query_start + found.num_tokens],
            )
        )
        segments.append(
            Segment(
                start=found.query_start,
                num_tokens=found.num_tokens,
                key=found.key,
                source_start=found.source_start,
                exact=exact,
                tier=tier,
            )
        )
    segments.sort(key=lambda segment: segment.start)
    if partial:
        segments = _with_slices(tokens, segments, catalog, pin)
    return segments


def _with_slices(
    tokens: TokenArray, segments: list[Segment], catalog: ContentCatalog, pin: PinFastest
) -> list[Segment]:
    """``segments`` (sorted) and the slices of stored chunks around them, sorted.

    A TAIL slice that continues an exact segment at its own positions is exact too: its chunk followed that
    segment's chunk in a stored sequence, and a prefix key names every token before it, so its rows were computed
    after the prompt's own tokens at the prompt's positions. Every other slice is blended.
    """
    if not segments or not gaps_between(tuple(segments), tokens.shape[0]):
        return segments  # nothing planned to continue, or nothing left to find
    anchors = [Anchor(segment.start, segment.num_tokens, segment.key) for segment in segments]
    found = catalog.partial_matches(tokens, anchors, pin)
    if not found:
        return segments
    ending_at = {segment.end: segment for segment in segments}
    for partial, tier in found:  # by query start: a TAIL after a TAIL sees whether the first was exact
        segment = _slice_segment(partial, tier, ending_at.get(partial.query_start))
        segments.append(segment)
        ending_at[segment.end] = segment
    segments.sort(key=lambda segment: segment.start)
    return segments


def _slice_segment(partial: PartialMatch, tier: TierName, before: Segment | None) -> Segment:
    """The segment of a partial match; ``before``: the segment ending where it starts (its anchor, for a TAIL)."""
    exact = (
        partial.follows
        and before is not None
        and before.exact
        and before.key == partial.anchor_key
        and partial.source_start == partial.query_start
    )
    whole = partial.num_tokens == partial.chunk_tokens  # the chunk matched to its end after all
    return Segment(
        start=partial.query_start,
        num_tokens=partial.num_tokens,
        key=partial.key,
        source_start=partial.source_start,
        exact=exact,
        tier=tier,
        offset=partial.offset,
        chunk_tokens=0 if whole else partial.chunk_tokens,
    )


def _separator_cuts(tokens: TokenArray, separator: Sequence[int], chunk_size: int) -> bool:
    """A fixed cut with a separator makes chunks windows miss: the prompt holds the separator, or is shorter than a
    chunk (its one chunk is a whole short run)."""
    if not separator:
        return False
    return tokens.shape[0] < chunk_size or len(separator_run_starts(tokens, separator)) > 1


def _leading_run_chunks(segments: Sequence[Segment]) -> int:
    """How many of the prompt's first chunks the prefix leg planned without a gap (one segment each)."""
    count = 0
    for segment in segments:
        if segment.start != (segments[count - 1].end if count else 0):
            break
        count += 1
    return count
