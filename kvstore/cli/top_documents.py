"""``kvstore inspect``'s top documents by hits: the rows, online (a server's live counts) and offline (the counts a
server saved in its data dir, with the tiers read from the disk), and the table both print."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvstore.data_dir.server_record import live_server_record
from kvstore.errors import KVStoreError
from kvstore.server.usage.documents import DocumentHits, top_document
from kvstore.server.usage.documents_file import load_document_hits
from kvstore.store.inspection import chunks_on_disk
from kvstore.tiers.base import TierName
from kvstore.wire.documents import TierChunks, TopDocument

__all__ = ["NO_HITS_NOTE", "TopDocuments", "render_top_documents", "saved_top_documents"]

NO_HITS_NOTE = "no hits recorded (hits are counted by a running server)"
_NUM_SHOWN_TOKENS = 6
_TABLE_WIDTH = 170


@dataclass(frozen=True, slots=True, kw_only=True)
class TopDocuments:
    """The most-hit documents and, when there are none or they may be stale, why (``note``)."""

    documents: tuple[TopDocument, ...]
    note: str | None = None

    def to_json_dict(self) -> dict[str, object]:
        return {"top_documents": [row.to_json_dict() for row in self.documents], "top_documents_note": self.note}


def saved_top_documents(path: Path, top: int) -> TopDocuments:
    """The ``top`` most-hit documents from the counts a server saved in the data dir ``path``.

    Never raises for the counts themselves: no file or an unreadable one becomes a ``note`` (the rest of
    ``kvstore inspect`` still works).
    """
    try:
        saved = load_document_hits(path)
    except KVStoreError as exc:
        return TopDocuments(documents=(), note=f"hit counts unreadable: {exc}")
    if saved is None:
        return TopDocuments(documents=(), note=NO_HITS_NOTE)
    counts = DocumentHits(
        max_documents=len(saved.documents) + 1,
        max_chunk_keys=sum(len(document.chunk_keys) for document in saved.documents) + 1,
    )
    counts.restore(saved.documents, saved.num_dropped)
    ranked = counts.top(top)
    on_disk = chunks_on_disk(path, [key for document in ranked for key in document.chunk_keys])
    rows = []
    for document in ranked:
        num_on_disk = sum(key in on_disk for key in document.chunk_keys)
        tiers = (TierChunks(tier=TierName.DISK, num_chunks=num_on_disk),) if num_on_disk else ()
        rows.append(top_document(document, tiers))
    saved_at = datetime.datetime.fromtimestamp(saved.saved_ns / 1e9, tz=datetime.UTC).isoformat(timespec="seconds")
    note = None if rows else "no hits recorded yet"
    server = live_server_record(path)
    if server is not None:
        note = f"counts as saved at {saved_at} (a server saves them every minute); live: --url {server.url}"
    return TopDocuments(documents=tuple(rows), note=note)


def render_top_documents(console: Console, top: TopDocuments, *, offline: bool) -> None:
    """Print the top documents as a table (or the note saying why there is none)."""
    if not top.documents:
        console.print(f"top documents: {top.note or 'no hits recorded yet'}")
        return
    table = Table(title="top documents by hits" + (" (saved by the last server)" if offline else ""))
    for column in ("first chunk key", "chunks", "tokens", "hits", "tokens served", "last hit (UTC)", "tiers"):
        table.add_column(column, no_wrap=True)
    table.add_column("first tokens", no_wrap=True, overflow="ellipsis")
    for row in top.documents:
        held = ", ".join(f"{tiers.tier.value} {tiers.num_chunks}/{row.num_chunks}" for tiers in row.tiers) or "evicted"
        preview = " ".join(str(token) for token in row.first_tokens[:_NUM_SHOWN_TOKENS])
        if len(row.first_tokens) > _NUM_SHOWN_TOKENS or row.num_tokens > len(row.first_tokens):
            preview += " ..."
        table.add_row(
            row.first_key, f"{row.num_chunks:,}", f"{row.num_tokens:,}", f"{row.num_hits:,}",
            f"{row.num_tokens_served:,}", _short_time(row.last_hit), held, preview,
        )  # fmt: skip
    # One line a document: 32-digit keys and six token ids need more than the usual 120 columns.
    Console(width=max(console.width, _TABLE_WIDTH), file=console.file).print(table)
    if top.note:
        console.print(top.note)


def _short_time(iso: str | None) -> str:
    """``2026-11-29T14:35:29+00:00`` as ``2026-11-29 14:35:29`` (the column says UTC)."""
    return iso.replace("T", " ").removesuffix("+00:00") if iso else "-"
