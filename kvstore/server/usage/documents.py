"""Hits per stored document: which documents the lookups a server plans actually reuse (``kvstore inspect``).

A *document* is the chunks one ``store()`` call added to what the server already knew, in order; its id is the key
of its first chunk. A document stored after a shared system prompt therefore starts at its own first chunk, and
the shared prompt is a document of its own: its hits are not smeared over every document that follows it. (The
same rule as the content catalog's relinking, ``content/relink.py``: of several sequences sharing a prefix, the
first keeps the prefix.)

A *hit* is one lookup plan that used any of a document's chunks (a prefix hit or a blend match; counted once per
plan), and the plan's tokens from that document are its *tokens served*. So an operator sees which documents earn
their space, and a long document is not ranked above a short one only for having more chunks.

Chunks the server never saw stored (written before it started, or dropped from tracking) are learned from the
plans that use them: consecutive segments that continue each other (the next starts where the previous ends, in the
prompt and in its source) form one document whose first key is the first of them. The store has no public map
from a chunk to its parent; with one (e.g. ``TieredStore.sequence_head(key)``) such documents would get their true
first chunk.

Bounded memory: at most ``max_documents`` documents and ``max_chunk_keys`` chunk keys are tracked (a chunk key
costs about 150 bytes in the maps, so 200,000 keys are about 30 MB). When either bound is passed, the least-hit
documents go first, the oldest activity first among equal hits, until both are at 90% of their bound: a server
that sees millions of distinct documents keeps the ones an operator looks at, and trims in batches so a store does
not sort the table each time. Dropped documents are counted (``num_dropped``).

Threads: any. ``_documents_lock`` guards ``_documents``, ``_document_of`` and ``_num_dropped``; the held time is
one dict operation per chunk of the request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvstore.keys import PrefixKey, TokenArray
from kvstore.plan import LookupPlan, Segment
from kvstore.tiers.base import TierName
from kvstore.wire.documents import NUM_PREVIEW_TOKENS, TierChunks, TopDocument

__all__ = ["DocumentHits", "DocumentSnapshot", "count_by_tier", "top_document"]

"""Token ids kept per document to show what it is."""

_TRIM_RATIO = 0.9


@dataclass(frozen=True, slots=True, kw_only=True)
class DocumentSnapshot:
    """One tracked document and its counters, as reported and persisted.

    Args:
        first_key: key of the document's first chunk (its id).
        chunk_keys: keys of its chunks, in order.
        num_tokens: tokens in its chunks.
        first_tokens: its first token ids (up to ``NUM_PREVIEW_TOKENS``).
        num_hits: lookup plans that used any of its chunks.
        num_tokens_served: tokens of its chunks in those plans.
        last_hit_ns: wall-clock time of the last hit (ns since the epoch), 0 when never hit.
        last_active_ns: wall-clock time it was last stored or hit (eviction order among equal hits).
    """

    first_key: PrefixKey
    chunk_keys: tuple[PrefixKey, ...]
    num_tokens: int
    first_tokens: tuple[int, ...]
    num_hits: int
    num_tokens_served: int
    last_hit_ns: int
    last_active_ns: int


@dataclass(slots=True, kw_only=True)
class _Document:
    """A tracked document's mutable counters; owned by ``DocumentHits`` and changed under its lock."""

    first_key: PrefixKey
    chunk_keys: list[PrefixKey]
    num_tokens: int
    first_tokens: tuple[int, ...]
    num_hits: int = 0
    num_tokens_served: int = 0
    last_hit_ns: int = 0
    last_active_ns: int = 0

    def snapshot(self) -> DocumentSnapshot:
        return DocumentSnapshot(
            first_key=self.first_key,
            chunk_keys=tuple(self.chunk_keys),
            num_tokens=self.num_tokens,
            first_tokens=self.first_tokens,
            num_hits=self.num_hits,
            num_tokens_served=self.num_tokens_served,
            last_hit_ns=self.last_hit_ns,
            last_active_ns=self.last_active_ns,
        )


class DocumentHits:
    """Documents the server stored or served, and how often lookups reused each.

    Args:
        max_documents: documents tracked before the least-hit are dropped.
        max_chunk_keys: chunk keys tracked (over all documents) before the least-hit documents are dropped.
        clock_ns: wall-clock time in ns since the epoch (tests pass their own).
    """

    def __init__(
        self,
        max_documents: int = 10_000,
        max_chunk_keys: int = 200_000,
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        if max_documents < 1 or max_chunk_keys < 1:
            raise ValueError(f"max_documents={max_documents} and max_chunk_keys={max_chunk_keys} must be >= 1")
        self.max_documents = max_documents
        self.max_chunk_keys = max_chunk_keys
        self._clock_ns = clock_ns
        self._documents_lock = threading.Lock()
        self._documents: dict[PrefixKey, _Document] = {}
        self._document_of: dict[PrefixKey, PrefixKey] = {}
        self._num_dropped = 0
        self._changes = 0

    # -- feeding -----------------------------------------------------------------------------------------------

    def add_stored(self, keys: Sequence[PrefixKey], tokens: TokenArray, bounds: Sequence[int]) -> PrefixKey | None:
        """Record a stored sequence: its chunks not yet part of a document become a new document.

        Args:
            keys: the sequence's prefix keys (``prefix_keys(namespace, tokens, chunk_size, separator)``).
            tokens: its token ids.
            bounds: where its chunks start, then ``len(tokens)`` (``kvstore.keys.chunk_bounds``).

        Returns:
            The new document's first key, or ``None`` when every chunk already belonged to a document.
        """
        with self._documents_lock:
            new_indexes = [index for index, key in enumerate(keys) if key not in self._document_of]
            if not new_indexes:
                return None
            first_index = new_indexes[0]
            start = bounds[first_index]
            num_tokens = sum(bounds[index + 1] - bounds[index] for index in new_indexes)
            document = _Document(
                first_key=keys[first_index],
                chunk_keys=[keys[index] for index in new_indexes],
                num_tokens=num_tokens,
                first_tokens=tuple(int(t) for t in tokens[start : start + NUM_PREVIEW_TOKENS]),
                last_active_ns=self._clock_ns(),
            )
            self._add(document)
            return document.first_key

    def add_plan(self, plan: LookupPlan, tokens: TokenArray) -> None:
        """Count a lookup plan: one hit for each document it used, and the tokens it used from each.

        Args:
            plan: the plan handed to the client.
            tokens: the prompt that was looked up (previews of documents learned from this plan).
        """
        if not plan.segments:
            return
        now_ns = self._clock_ns()
        with self._documents_lock:
            served: dict[PrefixKey, int] = {}
            for run in _unknown_runs(plan.segments, self._document_of):
                head = run[0]
                document = _Document(
                    first_key=head.key,
                    chunk_keys=[segment.key for segment in run],
                    num_tokens=sum(segment.num_tokens for segment in run),
                    first_tokens=tuple(int(t) for t in tokens[head.start : head.start + NUM_PREVIEW_TOKENS]),
                    last_active_ns=now_ns,
                )
                self._add(document)
            for segment in plan.segments:
                first_key = self._document_of.get(segment.key)
                if first_key is not None:  # None only if _add just trimmed it away
                    served[first_key] = served.get(first_key, 0) + segment.num_tokens
            for first_key, num_tokens in served.items():
                document = self._documents[first_key]
                document.num_hits += 1
                document.num_tokens_served += num_tokens
                document.last_hit_ns = document.last_active_ns = now_ns
            self._changes += 1

    def restore(self, documents: Iterable[DocumentSnapshot], num_dropped: int = 0) -> None:
        """Take back persisted documents (at start-up, before serving); keys already tracked keep their document."""
        with self._documents_lock:
            self._num_dropped += num_dropped
            for saved in documents:
                if saved.first_key in self._document_of:
                    continue
                self._add(
                    _Document(
                        first_key=saved.first_key,
                        chunk_keys=[key for key in saved.chunk_keys if key not in self._document_of],
                        num_tokens=saved.num_tokens,
                        first_tokens=saved.first_tokens,
                        num_hits=saved.num_hits,
                        num_tokens_served=saved.num_tokens_served,
                        last_hit_ns=saved.last_hit_ns,
                        last_active_ns=saved.last_active_ns,
                    )
                )

    # -- reading -----------------------------------------------------------------------------------------------

    def top(self, num_documents: int) -> list[DocumentSnapshot]:
        """The most-hit documents, at most ``num_documents`` (ties: more tokens served, then the latest hit first);
        documents never hit are left out."""
        with self._documents_lock:
            hit = [document for document in self._documents.values() if document.num_hits]
            ranked = sorted(hit, key=_rank, reverse=True)[:num_documents]
            return [document.snapshot() for document in ranked]

    def snapshot(self) -> list[DocumentSnapshot]:
        """Every tracked document (for persisting)."""
        with self._documents_lock:
            return [document.snapshot() for document in self._documents.values()]

    def document_of(self, key: PrefixKey) -> PrefixKey | None:
        """The first key of the document a chunk belongs to, if tracked."""
        with self._documents_lock:
            return self._document_of.get(key)

    @property
    def num_documents(self) -> int:
        with self._documents_lock:
            return len(self._documents)

    @property
    def num_dropped(self) -> int:
        """Documents dropped to keep within the bounds since the counts began (persisted counts included)."""
        with self._documents_lock:
            return self._num_dropped

    @property
    def num_changes(self) -> int:
        """Increases with every change (a saver compares it with the value it last saved)."""
        with self._documents_lock:
            return self._changes

    # -- bookkeeping (lock held) -------------------------------------------------------------------------------

    def _add(self, document: _Document) -> None:
        if not document.chunk_keys:
            return
        self._documents[document.first_key] = document
        for key in document.chunk_keys:
            self._document_of[key] = document.first_key
        self._changes += 1
        if len(self._documents) > self.max_documents or len(self._document_of) > self.max_chunk_keys:
            self._trim()

    def _trim(self) -> None:
        """Drop the least-hit, least recently active documents until both bounds are at 90%."""
        ranked = sorted(self._documents.values(), key=lambda d: (d.num_hits, d.last_active_ns))
        keep_documents = int(self.max_documents * _TRIM_RATIO)
        keep_keys = int(self.max_chunk_keys * _TRIM_RATIO)
        for document in ranked:
            if len(self._documents) <= keep_documents and len(self._document_of) <= keep_keys:
                break
            del self._documents[document.first_key]
            for key in document.chunk_keys:
                if self._document_of.get(key) == document.first_key:
                    del self._document_of[key]
            self._num_dropped += 1


def _rank(document: _Document) -> tuple[int, int, int]:
    return document.num_hits, document.num_tokens_served, document.last_hit_ns


def _unknown_runs(segments: Sequence[Segment], document_of: dict[PrefixKey, PrefixKey]) -> list[list[Segment]]:
    """Segments of chunks no document holds, grouped into runs that continue each other in prompt and source."""
    runs: list[list[Segment]] = []
    previous: Segment | None = None
    for segment in segments:
        if segment.key in document_of:
            previous = None
            continue
        if (
            previous is not None
            and segment.start == previous.end
            and segment.source_start == previous.source_start + previous.num_tokens
        ):
            runs[-1].append(segment)
        else:
            runs.append([segment])
        previous = segment
    # A chunk planned twice in one prompt (repeated text) must join one document only.
    seen: set[PrefixKey] = set()
    unique: list[list[Segment]] = []
    for run in runs:
        kept = [segment for segment in run if segment.key not in seen]
        seen.update(segment.key for segment in kept)
        if kept:
            unique.append(kept)
    return unique


def top_document(document: DocumentSnapshot, tiers: tuple[TierChunks, ...]) -> TopDocument:
    """A tracked document as a report row, with the tiers that hold its chunks now."""
    return TopDocument(
        first_key=document.first_key.hex(),
        num_chunks=len(document.chunk_keys),
        num_tokens=document.num_tokens,
        num_hits=document.num_hits,
        num_tokens_served=document.num_tokens_served,
        last_hit_ns=document.last_hit_ns,
        tiers=tiers,
        first_tokens=document.first_tokens,
    )


def count_by_tier(chunk_tiers: list[list[TierName]]) -> tuple[TierChunks, ...]:
    """Per tier (fastest first), how many of the chunks it holds, from each chunk's tiers."""
    counts = {tier: 0 for tier in TierName}
    for held_in in chunk_tiers:
        for tier in held_in:
            counts[tier] += 1
    return tuple(TierChunks(tier=tier, num_chunks=count) for tier, count in counts.items() if count)
