"""What a server needs to know of a data dir before its store opens it, without opening LMDB.

A server resolving its settings needs the layout, chunk size and cut rule the data dir recorded (to adopt them, or to
refuse flags that disagree) before it opens the store, and LMDB cannot open one environment twice in a process:
reading the info record first would mean opening the data dir twice at every start (read-only, then for the store).
So the disk tier keeps a copy of those values in ``layout.json`` beside ``data.mdb``: every writable open makes it
say what the info record says (a dir from before the copy, a damaged or edited copy), even an open it then refuses.
The info record in LMDB stays the truth: the store checks every open against it, so a wrong copy costs one refused
start, never wrong KV. Only a dir without a readable copy is probed read-only.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from kvstore.chunking import Chunking, parse_chunking
from kvstore.errors import ConfigError
from kvstore.layout import KVLayout
from kvstore.tiers.disk.data_file_check import DATA_FILE
from kvstore.tiers.disk.environment import DiskEnvironment

__all__ = ["LAYOUT_FILE", "keep_layout_copy", "read_layout_copy", "recorded_chunking", "recorded_layout"]

logger = logging.getLogger(__name__)

LAYOUT_FILE = "layout.json"
_PROBE_MAP_BYTES = 64 << 20  # a read-only open only to read the info record


def recorded_layout(data_dir: Path) -> tuple[KVLayout, int] | None:
    """The layout and chunk size a data dir recorded, or ``None`` for a fresh dir (no ``data.mdb``): read from the
    copy beside ``data.mdb``, or, for a dir without a readable copy, from the info record (a read-only open).

    Raises:
        StorageError: there is no readable copy and ``data.mdb`` cannot be opened (damaged, not LMDB) or its record
            is unreadable: the server must not start on it as if the dir were fresh, and must write nothing there.
            (With a readable copy, the store's own open finds such damage and refuses in the same words.)
    """
    if not (data_dir / DATA_FILE).is_file():
        return None
    copied = read_layout_copy(data_dir)
    if copied is not None:
        return copied
    env = DiskEnvironment(data_dir, read_only=True, map_size_bytes=_PROBE_MAP_BYTES)  # damage: StorageError
    try:
        info = env.read_info()
    finally:
        env.close()
    return (info.layout, info.chunk_size) if info is not None else None


def read_layout_copy(data_dir: Path) -> tuple[KVLayout, int] | None:
    """The copy's layout and chunk size, or ``None`` when it is missing or unreadable (then LMDB is asked)."""
    try:
        fields = json.loads((data_dir / LAYOUT_FILE).read_text(encoding="utf-8"))
        layout = KVLayout.from_json(json.dumps(fields["layout"]))
        chunk_size = fields["chunk_size"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, ConfigError) as exc:  # JSONDecodeError is a ValueError
        logger.warning("data dir %s: its %s is unreadable (%s); reading the layout from data.mdb", data_dir,
                       LAYOUT_FILE, exc)  # fmt: skip
        return None
    if type(chunk_size) is not int or chunk_size <= 0:
        logger.warning("data dir %s: its %s names chunk size %r; reading the layout from data.mdb", data_dir,
                       LAYOUT_FILE, chunk_size)  # fmt: skip
        return None
    return layout, chunk_size


def recorded_chunking(data_dir: Path) -> Chunking | None:
    """The cut rule a data dir recorded, or ``None`` for a fresh dir: from the copy beside ``data.mdb``, or from the
    info record (a read-only open) when the copy is missing, unreadable or older than the rule (``fixed`` then).

    Raises:
        StorageError: as ``recorded_layout``.
    """
    if not (data_dir / DATA_FILE).is_file():
        return None
    copied = _copied_chunking(data_dir)
    if copied is not None:
        return copied
    env = DiskEnvironment(data_dir, read_only=True, map_size_bytes=_PROBE_MAP_BYTES)
    try:
        info = env.read_info()
    finally:
        env.close()
    return info.chunking if info is not None else None


def _copied_chunking(data_dir: Path) -> Chunking | None:
    try:
        fields = json.loads((data_dir / LAYOUT_FILE).read_text(encoding="utf-8"))
        return parse_chunking(fields["chunking"])
    except (OSError, ValueError, KeyError, TypeError, ConfigError):  # JSONDecodeError is a ValueError
        return None


def keep_layout_copy(env: DiskEnvironment) -> None:
    """Make the copy say what the info record says, unless it does already (a writable open; a dir without a record
    yet has no copy). Atomic: a reader sees the old copy or the new one. A failure to write is logged, not raised:
    the copy only saves the next start a probe."""
    info = env.read_info()
    if info is None or (
        read_layout_copy(env.path) == (info.layout, info.chunk_size) and _copied_chunking(env.path) == info.chunking
    ):
        return
    data_dir, layout, chunk_size = env.path, info.layout, info.chunk_size
    target = data_dir / LAYOUT_FILE
    staged = data_dir / f".{LAYOUT_FILE}.{os.getpid()}"
    fields = {"layout": json.loads(layout.to_json()), "chunk_size": chunk_size, "chunking": info.chunking.value}
    text = json.dumps(fields, indent=2) + "\n"
    try:
        staged.write_text(text, encoding="utf-8")
        os.replace(staged, target)
    except OSError as exc:
        logger.warning("data dir %s: cannot write %s (%s); the next start probes data.mdb for the layout", data_dir,
                       LAYOUT_FILE, exc)  # fmt: skip
        staged.unlink(missing_ok=True)
