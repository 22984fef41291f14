"""The two legs of a lookup: the prompt's prefix keys (exact segments), then its content anywhere (blend segments).

``TieredStore.lookup`` runs them in order and pins every chunk they plan through ``pin`` (the fastest local tier
holding it, or the name of a shared tier that knows it, unpinned); a chunk ``pin`` cannot place is not planned.

Pure functions over the catalog and the callback; thread-safe as they are.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

from kvstore.chunking import Chunking
from kvstore.content.catalog import ContentCatalog
from kvstore.content.index import Match
from kvstore.keys import PrefixKey, TokenArray, chained_key, separator_run_starts
from kvstore.plan import Segment
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
) -> list[Segment]:
    """Add content matches that do not overlap the prefix leg's segments; returns all segments sorted (``on_gone``:
    ``ContentCatalog.match``'s).

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
    return segments


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
