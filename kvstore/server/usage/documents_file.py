"""``DIR/document-hits.msgpack``: a server's document hit counts, kept across restarts and read by offline inspect.

The server writes the file at shutdown and every ``save_interval_s`` (60 s) while the counts change, so a
``kill -9`` loses at most a minute of counting and offline ``kvstore inspect --data-dir`` shows what the last server
counted. Writes are atomic: a temporary file in the same directory, fsynced, then renamed over the old one, so a
reader (or a crash) never sees half a file. Layout, one msgpack map::

    {"version": 1, "saved_ns": int, "num_dropped": int,
     "documents": [{"first_key": bin16, "chunk_keys": bin (16 bytes a key, concatenated), "num_tokens": int,
                    "first_tokens": bin (little-endian uint32), "num_hits": int, "num_tokens_served": int,
                    "last_hit_ns": int, "last_active_ns": int}, ...]}

A file that cannot be read (truncated, another version, wrong types) is a ``StorageError`` naming the file; the
server then starts counting afresh (logged at WARNING), offline inspect says so.

``DocumentHitsSaver`` is the server's side: load at start, save when due or at shutdown, only when the counts
changed. A writer and a reader may run in different processes at once (the rename makes that safe).

Threads: the functions are pure. ``DocumentHitsSaver._save_lock`` keeps two saves (the janitor's, shutdown's) from
interleaving and guards ``_saved_changes`` and ``_saved_s``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import msgpack
import numpy as np

from kvstore.errors import KVStoreError, StorageError
from kvstore.keys import KEY_BYTES, PrefixKey
from kvstore.server.usage.documents import DocumentHits, DocumentSnapshot
from kvstore.wire.documents import NUM_PREVIEW_TOKENS
from kvstore.wire.error_codes import RequestError
from kvstore.wire.fields import Fields

__all__ = ["DOCUMENT_HITS_FILE", "DocumentHitsSaver", "SavedDocumentHits", "load_document_hits", "save_document_hits"]

logger = logging.getLogger(__name__)

DOCUMENT_HITS_FILE = "document-hits.msgpack"
_FORMAT_VERSION = 1
_MAX_COUNT = 2**63 - 1
_MAX_DOCUMENTS = 10_000_000
_MAX_FILE_BYTES = 1 << 31


@dataclass(frozen=True, slots=True, kw_only=True)
class SavedDocumentHits:
    """What a server saved: its documents, when, and how many it had dropped to stay bounded."""

    documents: tuple[DocumentSnapshot, ...]
    saved_ns: int
    num_dropped: int


def save_document_hits(data_dir: Path, saved: SavedDocumentHits) -> None:
    """Write the counts atomically into ``data_dir``.

    Raises:
        StorageError: the file cannot be written (full disk, permissions).
    """
    path = Path(data_dir) / DOCUMENT_HITS_FILE
    temporary = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    body = msgpack.packb(
        {
            "version": _FORMAT_VERSION,
            "saved_ns": saved.saved_ns,
            "num_dropped": saved.num_dropped,
            "documents": [_document_to_map(document) for document in saved.documents],
        },
        use_bin_type=True,
    )
    try:
        with open(temporary, "wb") as file:
            file.write(body)
            file.flush()
            os.fsync(file.fileno())
        temporary.replace(path)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        raise StorageError(
            f"cannot save document hit counts to {path}: {exc}; check the data dir's free space"
        ) from exc


def load_document_hits(data_dir: Path) -> SavedDocumentHits | None:
    """Read the counts a server saved in ``data_dir``; ``None`` when it saved none.

    Raises:
        StorageError: the file exists but cannot be read or decoded.
    """
    path = Path(data_dir) / DOCUMENT_HITS_FILE
    try:
        with open(path, "rb") as file:
            body = file.read(_MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StorageError(f"cannot read {path}: {exc}") from exc
    try:
        if len(body) > _MAX_FILE_BYTES:
            raise ValueError(f"over {_MAX_FILE_BYTES:,} bytes")
        fields = Fields(msgpack.unpackb(body, raw=False, strict_map_key=True), DOCUMENT_HITS_FILE)
        version = fields.required_int("version", 0, _MAX_COUNT)
        if version != _FORMAT_VERSION:
            raise ValueError(f"format version {version}, this kvstore reads {_FORMAT_VERSION}")
        saved_ns = fields.required_int("saved_ns", 0, _MAX_COUNT)
        num_dropped = fields.required_int("num_dropped", 0, _MAX_COUNT)
        documents = tuple(
            _document_from_map(Fields(raw, f"documents[{index}]"))
            for index, raw in enumerate(fields.list_("documents", _MAX_DOCUMENTS))
        )
        fields.finish()
    except (RequestError, ValueError, TypeError, msgpack.UnpackException) as exc:
        raise StorageError(
            f"{path} is not a readable document hit count file ({exc}); a server rewrites it within a minute, "
            "or delete it to start counting afresh"
        ) from exc
    return SavedDocumentHits(documents=documents, saved_ns=saved_ns, num_dropped=num_dropped)


def _document_to_map(document: DocumentSnapshot) -> dict[str, object]:
    return {
        "first_key": bytes(document.first_key),
        "chunk_keys": b"".join(document.chunk_keys),
        "num_tokens": document.num_tokens,
        "first_tokens": np.asarray(document.first_tokens, dtype="<u4").tobytes(),
        "num_hits": document.num_hits,
        "num_tokens_served": document.num_tokens_served,
        "last_hit_ns": document.last_hit_ns,
        "last_active_ns": document.last_active_ns,
    }


def _document_from_map(fields: Fields) -> DocumentSnapshot:
    first_key = PrefixKey(fields.bytes_("first_key", max_length=KEY_BYTES, exact_length=KEY_BYTES))
    joined = fields.bytes_("chunk_keys", max_length=_MAX_FILE_BYTES, multiple_of=KEY_BYTES)
    chunk_keys = tuple(PrefixKey(joined[offset : offset + KEY_BYTES]) for offset in range(0, len(joined), KEY_BYTES))
    num_tokens = fields.required_int("num_tokens", 0, _MAX_COUNT)
    preview = fields.bytes_("first_tokens", max_length=4 * NUM_PREVIEW_TOKENS, multiple_of=4)
    document = DocumentSnapshot(
        first_key=first_key,
        chunk_keys=chunk_keys,
        num_tokens=num_tokens,
        first_tokens=tuple(int(t) for t in np.frombuffer(preview, dtype="<u4")),
        num_hits=fields.required_int("num_hits", 0, _MAX_COUNT),
        num_tokens_served=fields.required_int("num_tokens_served", 0, _MAX_COUNT),
        last_hit_ns=fields.required_int("last_hit_ns", 0, _MAX_COUNT),
        last_active_ns=fields.required_int("last_active_ns", 0, _MAX_COUNT),
    )
    fields.finish()
    if not chunk_keys or chunk_keys[0] != first_key:
        raise ValueError(f"document {first_key.hex()} does not start with its first key")
    return document


class DocumentHitsSaver:
    """Keeps a server's ``DocumentHits`` in its data dir.

    Args:
        documents: the counts to load into and save.
        data_dir: the server's data dir.
        save_interval_s: ``save_if_due`` writes at most this often (and only when the counts changed).
    """

    def __init__(self, documents: DocumentHits, data_dir: str | Path, save_interval_s: float = 60.0) -> None:
        self._documents = documents
        self._data_dir = Path(data_dir)
        self._save_interval_s = save_interval_s
        self._save_lock = threading.Lock()
        self._saved_changes = -1  # never saved: the first save writes, even an empty count over an existing file
        self._saved_s = time.monotonic()

    def load(self) -> None:
        """Take back the counts a previous server saved; an unreadable file is logged and counting starts afresh."""
        try:
            saved = load_document_hits(self._data_dir)
        except KVStoreError as exc:
            logger.warning("document hit counts start afresh: %s", exc)
            return
        if saved is None:
            return
        self._documents.restore(saved.documents, saved.num_dropped)
        with self._save_lock:
            self._saved_changes = self._documents.num_changes
        logger.info("loaded the hit counts of %d documents from %s", len(saved.documents), self._data_dir)

    def save_if_due(self) -> bool:
        """Save if ``save_interval_s`` passed since the last save and the counts changed; whether it wrote."""
        with self._save_lock:
            if time.monotonic() - self._saved_s < self._save_interval_s:
                return False
        return self.save()

    def save(self) -> bool:
        """Save now if the counts changed since the last save; whether it wrote.

        Raises:
            StorageError: the file cannot be written.
        """
        with self._save_lock:
            self._saved_s = time.monotonic()
            changes = self._documents.num_changes  # read first: a change after it is saved next time
            if changes == self._saved_changes:
                return False
            documents = tuple(self._documents.snapshot())
            path = self._data_dir / DOCUMENT_HITS_FILE
            if not documents and not self._documents.num_dropped and not path.exists():
                # Nothing counted and no file to replace: a server whose data dir was never opened (no client named
                # a layout) leaves it as it found it, not a dir offline inspect cannot read.
                return False
            self._data_dir.mkdir(parents=True, exist_ok=True)
            saved = SavedDocumentHits(
                documents=documents, saved_ns=time.time_ns(), num_dropped=self._documents.num_dropped
            )
            save_document_hits(self._data_dir, saved)
            self._saved_changes = changes
        logger.debug("saved the hit counts of %d documents into %s", len(documents), self._data_dir)
        return True
