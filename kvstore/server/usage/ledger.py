"""``UsageLedger``: everything the server counts about what its lookups used, behind one entry point.

One vocabulary (the same as ``TierStats``'s): **a hit is one chunk a lookup plan used** (planned from some tier).
From there:

- a chunk's ``hits``: plans that used it (``chunk_hits``; bounded, most-hit kept);
- a document's ``hits``: plans that used any of its chunks, and ``tokens_served``: its tokens in those plans
  (``documents``; a document is what one store call added; kept in the data dir across restarts, ``documents_file``);
- a plan's coverage: its exact, blend and gap tokens and chunks per tier (``plan_coverage``), which the Prometheus
  metrics count per engine (``kvstore.server.metrics``);
- per tier, hits and misses are the store's own (``kvstore.store.lookup_counts``), not the server's.

The request handler tells the ledger what it stored and planned, and asks it for reports; it keeps no counter of
its own.

Threads: any (each part has its own lock).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from kvstore.keys import PrefixKey, TokenArray
from kvstore.plan import LookupPlan
from kvstore.server.usage.chunk_hits import ChunkHitCounter
from kvstore.server.usage.documents import DocumentHits, count_by_tier, top_document
from kvstore.server.usage.documents_file import DocumentHitsSaver
from kvstore.server.usage.plan_coverage import PlanCoverage
from kvstore.tiers.base import TierName
from kvstore.wire.documents import DocumentsReport

__all__ = ["UsageLedger"]


class UsageLedger:
    """What the server's lookups used, per chunk, per stored document and per plan.

    Args:
        data_dir: where document hit counts are kept across restarts (``None``: memory only); loaded now.
        documents: the document counts to use (a fresh ``DocumentHits`` unless given; tests pass small bounds).
        save_interval_s: how often ``save_if_due`` writes changed document counts.
    """

    def __init__(
        self, data_dir: Path | None, *, documents: DocumentHits | None = None, save_interval_s: float = 60.0
    ) -> None:
        self._chunks = ChunkHitCounter()
        self._documents = documents if documents is not None else DocumentHits()
        self._saver = DocumentHitsSaver(self._documents, data_dir, save_interval_s) if data_dir is not None else None
        if self._saver is not None:
            self._saver.load()

    def stored(self, keys: Sequence[PrefixKey], tokens: TokenArray, bounds: Sequence[int]) -> None:
        """A store call added the chunks ``keys`` of ``tokens`` (cut at ``bounds``): one document."""
        self._documents.add_stored(keys, tokens, bounds)

    def planned(self, plan: LookupPlan, tokens: TokenArray, chunk_size: int) -> PlanCoverage:
        """A lookup handed out ``plan`` for ``tokens``: count its hits; returns its coverage for the metrics."""
        self._chunks.add([segment.key for segment in plan.segments])
        self._documents.add_plan(plan, tokens)
        return PlanCoverage.of(plan, chunk_size)

    def chunk_hits(self, key: PrefixKey) -> int:
        return self._chunks.hits(key)

    def top_chunks(self, num_chunks: int) -> list[tuple[PrefixKey, int]]:
        return self._chunks.top(num_chunks)

    def top_documents(self, num_documents: int, tiers_of: Callable[[PrefixKey], list[TierName]]) -> DocumentsReport:
        """The most-hit documents, each with the tiers that hold its chunks now (``tiers_of`` a chunk key)."""
        documents = self._documents
        rows = tuple(
            top_document(document, count_by_tier([tiers_of(key) for key in document.chunk_keys]))
            for document in documents.top(num_documents)
        )
        return DocumentsReport(
            documents=rows,
            num_tracked=documents.num_documents,
            num_dropped=documents.num_dropped,
            max_documents=documents.max_documents,
        )

    def save_if_due(self) -> None:
        """Save changed document counts if ``save_interval_s`` passed (a janitor's pass); no-op without a data dir."""
        if self._saver is not None:
            self._saver.save_if_due()

    def save(self) -> None:
        """Save changed document counts now (at shutdown); no-op without a data dir.

        Raises:
            StorageError: the file cannot be written.
        """
        if self._saver is not None:
            self._saver.save()
