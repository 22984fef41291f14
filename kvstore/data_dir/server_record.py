"""``DIR/serve.json``: which running server holds a data dir, so offline tools can point at it.

The disk tier's ``LOCK`` (flock) is what keeps a second writer out; this file only adds where that writer can be
reached. ``kvstore serve`` writes it once it listens and removes it when it exits; a server killed with -9 leaves
it behind, which is harmless: ``live_server_record`` ignores a record whose pid is gone.

Offline ``kvstore evict`` reads it to refuse with "held by kvstore serve (pid N) at tcp://...; use
``kvstore evict --url tcp://...``" instead of a bare pid.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from kvstore.pids import pid_alive

__all__ = ["ServerRecord", "live_server_record", "remove_server_record", "write_server_record"]

logger = logging.getLogger(__name__)

_RECORD_FILE = "serve.json"


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerRecord:
    """A running server's address."""

    pid: int
    url: str
    metrics_url: str


def write_server_record(data_dir: Path, record: ServerRecord) -> None:
    """Write the record atomically (a reader never sees half a file)."""
    Path(data_dir).mkdir(parents=True, exist_ok=True)  # a fresh dir: the store opens at the first client's hello
    path = Path(data_dir) / _RECORD_FILE
    temporary = path.with_suffix(f".tmp-{os.getpid()}")
    temporary.write_text(json.dumps({"pid": record.pid, "url": record.url, "metrics_url": record.metrics_url}))
    temporary.replace(path)


def remove_server_record(data_dir: Path) -> None:
    """Remove the record if it is this process's. Idempotent."""
    record = live_server_record(data_dir)
    if record is not None and record.pid == os.getpid():
        (Path(data_dir) / _RECORD_FILE).unlink(missing_ok=True)


def live_server_record(data_dir: Path) -> ServerRecord | None:
    """The record of the server holding ``data_dir``, or ``None`` when there is none or its process is gone."""
    try:
        raw = json.loads((Path(data_dir) / _RECORD_FILE).read_text())
        record = ServerRecord(pid=int(raw["pid"]), url=str(raw["url"]), metrics_url=str(raw["metrics_url"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record if pid_alive(record.pid) else None
