"""The ``documents`` operation and its report: the most-hit stored documents, for ``kvstore inspect``.

    op         args                 result
    documents  top (1..1000)        documents: [TopDocument...], num_tracked, num_dropped, max_documents

A ``TopDocument`` on the wire is a map (``first_key`` as a 16-byte bin, ``first_tokens`` as little-endian uint32
bin, ``tiers`` as ``[[tier, num_chunks], ...]``).

The same report is built offline from the counts a server saved in its data dir (``document_hits_file``), with
the tiers read from the disk.

Pure values; thread-safe.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import numpy as np

from kvstore.keys import KEY_BYTES
from kvstore.tiers.base import TierName
from kvstore.wire.error_codes import ErrorCode, RequestError
from kvstore.wire.fields import Fields
from kvstore.wire.protocol import Limits

__all__ = [
    "MAX_TOP_DOCUMENTS",
    "NUM_PREVIEW_TOKENS",
    "DocumentsArgs",
    "DocumentsReport",
    "TierChunks",
    "TopDocument",
]

MAX_TOP_DOCUMENTS = 1000
NUM_PREVIEW_TOKENS = 16
"""First token ids of a document a report shows."""
_MAX_COUNT = 2**63 - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class DocumentsArgs:
    """Ask for the ``top`` most-hit documents."""

    top: int

    @classmethod
    def parse(cls, fields: Fields, limits: Limits) -> DocumentsArgs:
        parsed = cls(top=fields.required_int("top", 1, MAX_TOP_DOCUMENTS))
        fields.finish()
        return parsed

    def to_wire(self) -> dict[str, object]:
        return {"top": self.top}


@dataclass(frozen=True, slots=True, kw_only=True)
class TierChunks:
    """How many of a document's chunks one tier holds."""

    tier: TierName
    num_chunks: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TopDocument:
    """One document in ``kvstore inspect``'s top list.

    Args:
        first_key: key of its first chunk (32 hex digits; ``kvstore inspect --key`` shows that chunk).
        num_chunks: chunks in the document.
        num_tokens: tokens in the document.
        num_hits: lookup plans that used any of its chunks.
        num_tokens_served: tokens of its chunks in those plans.
        last_hit_ns: wall-clock time of the last hit (ns since the epoch), 0 when never hit.
        tiers: chunks of it each tier holds now (tiers holding none are left out).
        first_tokens: its first token ids.
    """

    first_key: str
    num_chunks: int
    num_tokens: int
    num_hits: int
    num_tokens_served: int
    last_hit_ns: int
    tiers: tuple[TierChunks, ...]
    first_tokens: tuple[int, ...]

    @property
    def last_hit(self) -> str | None:
        """The last hit as ISO-8601 UTC, ``None`` when never hit."""
        if not self.last_hit_ns:
            return None
        moment = datetime.datetime.fromtimestamp(self.last_hit_ns / 1e9, tz=datetime.UTC)
        return moment.isoformat(timespec="seconds")

    def to_json_dict(self) -> dict[str, object]:
        """The row of ``kvstore inspect --json``'s ``top_documents``."""
        return {
            "first_key": self.first_key,
            "num_chunks": self.num_chunks,
            "num_tokens": self.num_tokens,
            "hits": self.num_hits,
            "tokens_served": self.num_tokens_served,
            "last_hit": self.last_hit,
            "tiers": {held.tier.value: held.num_chunks for held in self.tiers},
            "first_tokens": list(self.first_tokens),
        }

    def to_wire(self) -> dict[str, object]:
        return {
            "first_key": bytes.fromhex(self.first_key),
            "num_chunks": self.num_chunks,
            "num_tokens": self.num_tokens,
            "num_hits": self.num_hits,
            "num_tokens_served": self.num_tokens_served,
            "last_hit_ns": self.last_hit_ns,
            "tiers": [[held.tier.value, held.num_chunks] for held in self.tiers],
            "first_tokens": np.asarray(self.first_tokens, dtype="<u4").tobytes(),
        }

    @classmethod
    def from_wire(cls, fields: Fields) -> TopDocument:
        first_key = fields.bytes_("first_key", max_length=KEY_BYTES, exact_length=KEY_BYTES)
        counts = {
            name: fields.required_int(name, 0, _MAX_COUNT)
            for name in ("num_chunks", "num_tokens", "num_hits", "num_tokens_served", "last_hit_ns")
        }
        tiers = []
        for raw in fields.list_("tiers", len(TierName)):
            if not (
                isinstance(raw, list) and len(raw) == 2 and raw[0] in {t.value for t in TierName}
                and type(raw[1]) is int and raw[1] >= 0
            ):  # fmt: skip
                raise RequestError(ErrorCode.MALFORMED, f"document tiers item {raw!r:.100} is not [tier, num_chunks]")
            tiers.append(TierChunks(tier=TierName(raw[0]), num_chunks=raw[1]))
        preview = fields.bytes_("first_tokens", max_length=4 * NUM_PREVIEW_TOKENS, multiple_of=4)
        fields.finish()
        return cls(
            first_key=first_key.hex(),
            tiers=tuple(tiers),
            first_tokens=tuple(int(t) for t in np.frombuffer(preview, dtype="<u4")),
            **counts,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class DocumentsReport:
    """The ``documents`` reply.

    Args:
        documents: the most-hit documents, most hits first.
        num_tracked: documents the counts cover now.
        num_dropped: documents dropped to keep within ``max_documents`` (their counts are gone).
        max_documents: most documents tracked at once.
    """

    documents: tuple[TopDocument, ...]
    num_tracked: int
    num_dropped: int
    max_documents: int

    def to_wire(self) -> dict[str, object]:
        return {
            "documents": [document.to_wire() for document in self.documents],
            "num_tracked": self.num_tracked,
            "num_dropped": self.num_dropped,
            "max_documents": self.max_documents,
        }

    @classmethod
    def from_wire(cls, fields: Fields) -> DocumentsReport:
        documents = tuple(
            TopDocument.from_wire(Fields(raw, f"documents[{index}]"))
            for index, raw in enumerate(fields.list_("documents", MAX_TOP_DOCUMENTS))
        )
        report = cls(
            documents=documents,
            num_tracked=fields.required_int("num_tracked", 0, _MAX_COUNT),
            num_dropped=fields.required_int("num_dropped", 0, _MAX_COUNT),
            max_documents=fields.required_int("max_documents", 0, _MAX_COUNT),
        )
        fields.finish()
        return report
