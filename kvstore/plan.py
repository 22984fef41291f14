"""Values a lookup returns and a retrieve consumes: the *plan* of a prompt.

A plan says which ranges of a prompt have cached KV, whose KV it is, and which ranges the engine must compute::

    prompt:  | seg 0 (exact, cpu) | seg 1 (exact, disk) | gap | seg 2 (blend, gpu) | gap ............. |
             0                    256                   512  520                  776               1030

- An **exact** segment comes from the prefix leg: its prefix key equals the prompt's own key at that chunk, so
  its KV was computed for the same tokens at the same positions and can be used as is.
- A **blend** segment (``exact=False``) comes from the match leg (the content fingerprint index) or from a
  dedup-content alias: the same tokens, computed at ``source_start`` after other preceding tokens. The engine
  rotates its K by ``rope_delta`` and recomputes a selection of its tokens (CacheBlend).
- A **slice** (``chunk_tokens > 0``) is a segment holding only rows ``[offset, offset + num_tokens)`` of its stored
  chunk: the longest stretch of a stored chunk the prompt holds token for token where the whole chunk does not
  match (``kvstore.content.partials``: a document's head or tail that ran into other text when it was stored). Its
  ``source_start`` is the position of its first row, so ``rope_delta`` is the same as a whole chunk's.
- **Gaps** are everything else: computed from scratch.

The chunks of a plan are pinned in their tiers until the plan is retrieved or released, or its session ends, so a
retrieve never finds them gone. Disk-resident chunks are prefetched into the cpu tier in the background:
``plan.ready`` polls, ``plan.wait()`` blocks, and ``retrieve`` waits by itself. Values are immutable and safe to
share between threads.
"""

from __future__ import annotations

import concurrent.futures
import enum
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvstore.keys import PrefixKey
from kvstore.misses import Miss
from kvstore.tiers.base import TierName

__all__ = [
    "UNPINNED_PLAN_ID",
    "ChunkOutcome",
    "ChunkResult",
    "Gap",
    "Loan",
    "LookupPlan",
    "RetrieveProgress",
    "RetrieveResult",
    "Segment",
    "StoreResult",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Segment:
    """A range of the prompt whose KV one cached chunk provides.

    Args:
        start: position of the segment's first token in the prompt.
        num_tokens: tokens in the segment (the chunk's length, or the slice's).
        key: prefix key of the stored chunk whose KV is used.
        source_start: position the chunk's KV was computed at.
        exact: the KV was computed for these tokens after the same preceding tokens (a prefix-key hit); when
            ``False`` the engine must re-rotate and blend.
        tier: the fastest tier that held the chunk at lookup time (where it is pinned).
        offset: rows of the stored chunk before the segment's first token (a slice; 0 otherwise).
        chunk_tokens: the stored chunk's length when the segment is a slice of it (``offset + num_tokens`` at
            most); 0: the segment is the whole chunk.
    """

    start: int
    num_tokens: int
    key: PrefixKey
    source_start: int
    exact: bool
    tier: TierName
    offset: int = 0
    chunk_tokens: int = 0

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def is_slice(self) -> bool:
        """Whether the segment holds only part of its stored chunk."""
        return self.chunk_tokens > 0

    @property
    def stored_tokens(self) -> int:
        """The stored chunk's length: what a tier holds under ``key`` (the segment's own length unless a slice)."""
        return self.chunk_tokens or self.num_tokens

    @property
    def rope_delta(self) -> int:
        """Positions to rotate the cached K by: ``start - source_start``."""
        return self.start - self.source_start


@dataclass(frozen=True, slots=True, kw_only=True)
class Gap:
    """A range of the prompt with no cached KV: ``[start, end)`` must be computed."""

    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def gaps_between(segments: tuple[Segment, ...], num_query_tokens: int, start: int = 0) -> tuple[Gap, ...]:
    """The ranges of ``[start, num_query_tokens)`` no segment covers (segments sorted, non-overlapping; the first
    may begin before ``start``)."""
    gaps: list[Gap] = []
    cursor = start
    for segment in segments:
        if segment.start > cursor:
            gaps.append(Gap(start=cursor, end=segment.start))
        cursor = max(cursor, segment.end)
    if cursor < num_query_tokens:
        gaps.append(Gap(start=cursor, end=num_query_tokens))
    return tuple(gaps)


def exact_prefix_tokens(segments: tuple[Segment, ...], start: int = 0) -> int:
    """Tokens covered from position 0 by contiguous exact segments: what a prefix-only engine can skip. ``start``:
    tokens the caller already holds (a retrieve from ``start``), counted as covered; the first segment may begin
    before it."""
    cursor = start
    for segment in segments:
        if not segment.exact or segment.start > cursor:
            break
        cursor = max(cursor, segment.end)
    return cursor


UNPINNED_PLAN_ID = 0
"""The ``plan_id`` of a plan that holds no pins (a server's ``lookup(pin=False)``): a look at what is cached, with
nothing to retrieve or release (store plan ids start at 1)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LookupPlan:
    """What of a prompt is cached, where, and what must be computed.

    Args:
        plan_id: the store's handle for the pins this plan holds (``UNPINNED_PLAN_ID``: none).
        session_id: the session whose end releases the plan (``None``: only retrieve or release do).
        num_query_tokens: length of the prompt that was looked up.
        segments: cached ranges, sorted by ``start``, non-overlapping.
        misses: the other ranges (the gaps), each with why it is not cached (``kvstore.misses``); with the segments
            they tile the prompt.
        prefetches: one future per disk-resident segment being copied into the cpu tier; each resolves to whether
            the copy landed (a ``False`` is harmless: retrieve then reads the disk directly).
    """

    plan_id: int
    session_id: str | None
    num_query_tokens: int
    segments: tuple[Segment, ...]
    misses: tuple[Miss, ...] = ()
    prefetches: tuple[concurrent.futures.Future[bool], ...] = ()

    @property
    def gaps(self) -> tuple[Gap, ...]:
        return gaps_between(self.segments, self.num_query_tokens)

    @property
    def num_cached_tokens(self) -> int:
        """Tokens some segment covers (exact or blend)."""
        return sum(segment.num_tokens for segment in self.segments)

    @property
    def num_prefix_tokens(self) -> int:
        """Leading tokens covered by exact segments without a gap."""
        return exact_prefix_tokens(self.segments)

    @property
    def end(self) -> int:
        """End of the last segment (0 when nothing is cached): the tokens a retrieve buffer must hold."""
        return self.segments[-1].end if self.segments else 0

    @property
    def ready(self) -> bool:
        """Whether every background prefetch has finished (poll this, or ``wait``)."""
        return all(future.done() for future in self.prefetches)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the prefetches finish or ``timeout`` seconds pass; returns ``ready``."""
        concurrent.futures.wait(self.prefetches, timeout=timeout)
        return self.ready

    def num_tokens_in(self, tier: TierName) -> int:
        """Cached tokens that were found in ``tier``."""
        return sum(segment.num_tokens for segment in self.segments if segment.tier is tier)


class RetrieveProgress(Protocol):
    """Told how far a layer-by-layer retrieve has got, so a consumer can start on layer 0 before layer 31 lands.

    ``TieredStore.retrieve(..., progress=...)`` first loads the segments that need decoding (disk), then calls
    ``segments_loaded`` once with the segments that will be in the result (a corrupt chunk is already a gap), then
    queues the copies of every layer in order, calling ``layer_queued(layer)`` after each. On a device buffer the
    copies run on the caller's current stream: an event recorded in ``layer_queued`` completes when that layer (and
    every one before it) has landed. Called on the retrieving thread.
    """

    def segments_loaded(self, segments: tuple[Segment, ...]) -> None: ...

    def layer_queued(self, layer: int) -> None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Loan:
    """A plan's chunks lent from a shared cpu arena, from token ``start`` on (``TieredStore.lend``).

    Args:
        segments: the plan's segments that end after ``start``, in order (the first may begin before it).
        offsets: each segment's chunk: the byte offset of its slot in the arena (its KV is the layout's
            ``chunk_shape(segment.stored_tokens)`` there; a slice takes rows ``[offset, offset + num_tokens)``).
        num_query_tokens: the prompt's length.
        start: the first token the caller wants; it holds ``[0, start)``.
        misses: the gaps of ``[start, num_query_tokens)`` with their reasons (the plan's).
    """

    segments: tuple[Segment, ...]
    offsets: tuple[int, ...]
    num_query_tokens: int
    start: int
    misses: tuple[Miss, ...]

    @property
    def num_prefix_tokens(self) -> int:
        """Leading tokens lent (or held by the caller, before ``start``) from exact segments without a gap."""
        return exact_prefix_tokens(self.segments, self.start)


@dataclass(frozen=True, slots=True, kw_only=True)
class RetrieveResult:
    """KV loaded for a plan.

    Args:
        segments: the segments whose KV was loaded (a chunk that turned out corrupt on disk is missing here and
            its range is a gap; without segmented prefix the exact segments after it are dropped too).
        num_query_tokens: length of the prompt.
        kv: ``[num_layers, 2, end - start, num_kv_heads, head_dim]`` where ``end`` is the last loaded segment's
            end (``start`` when none loaded): token ``start + i`` at index ``i``; gaps are left as they were (a view
            of the caller's buffer when one was given).
        start: the first token retrieved; the caller holds ``[0, start)`` (``retrieve(start=...)``), and the
            segments that end there are neither loaded nor listed (the first listed may begin before it).
        misses: the gaps of ``[start, num_query_tokens)``, each with its reason: the plan's, and the planned
            segments that could not be served (``checksum``, ``evicted_remote``, ``remote_unavailable``,
            ``disk_slower`` under ``memory_only``, ``behind_gap`` after one of those without segmented prefix).
    """

    segments: tuple[Segment, ...]
    num_query_tokens: int
    kv: torch.Tensor
    start: int = 0
    misses: tuple[Miss, ...] = ()

    @property
    def gaps(self) -> tuple[Gap, ...]:
        """The ranges of ``[start, num_query_tokens)`` not loaded."""
        return gaps_between(self.segments, self.num_query_tokens, self.start)

    @property
    def num_prefix_tokens(self) -> int:
        """Leading tokens loaded (or held by the caller, before ``start``) from exact segments without a gap."""
        return exact_prefix_tokens(self.segments, self.start)

    @property
    def num_cached_tokens(self) -> int:
        return sum(segment.num_tokens for segment in self.segments)


class ChunkOutcome(enum.Enum):
    """What a ``store`` call did with one chunk it was handed."""

    WRITTEN = "written"
    """Not stored before: written into the fastest local tier with room."""
    HELD = "held"
    """Already stored (in a local tier, or as a dedup alias): left as it was."""
    ALIASED = "aliased"
    """Its content was already stored under another key: recorded as an alias of that copy (dedup-content)."""
    REJECTED = "rejected"
    """No tier could take it: everything resident was pinned."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkResult:
    """One chunk of a ``store`` call: where it lies in the sequence and what the store did with it.

    Args:
        key: the chunk's prefix key.
        start: position of its first token in the stored sequence.
        end: position after its last token.
        outcome: what the store did with it.
    """

    key: PrefixKey
    start: int
    end: int
    outcome: ChunkOutcome

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreResult:
    """What a ``store`` call did.

    The counts travel over the wire; ``chunks`` does not (a ``Client``'s result has the counts only), so a caller
    in the store's process (the server's store handler) reads what happened to each chunk without asking the tiers
    again.

    Args:
        num_chunks: chunks the tokens split into.
        num_new_chunks: chunks that were not cached before and were written.
        num_rejected_chunks: chunks no tier could take because everything resident was pinned.
        num_aliased_chunks: new chunks whose content was already stored under another key (dedup-content): recorded
            as aliases of that copy instead of a second payload.
        chunks: each chunk handed over, in sequence order, when the store itself answered (empty otherwise).
    """

    num_chunks: int
    num_new_chunks: int
    num_rejected_chunks: int = 0
    num_aliased_chunks: int = 0
    chunks: tuple[ChunkResult, ...] = ()

    def __post_init__(self) -> None:
        if self.chunks:
            assert len(self.chunks) == self.num_chunks, "StoreResult.chunks must list every chunk num_chunks counts"

    @staticmethod
    def of(chunks: Sequence[ChunkResult]) -> StoreResult:
        """The result of a store that did ``chunks``, its counts taken from their outcomes."""
        outcomes = Counter(chunk.outcome for chunk in chunks)
        return StoreResult(
            num_chunks=len(chunks),
            num_new_chunks=outcomes[ChunkOutcome.WRITTEN],
            num_rejected_chunks=outcomes[ChunkOutcome.REJECTED],
            num_aliased_chunks=outcomes[ChunkOutcome.ALIASED],
            chunks=tuple(chunks),
        )
