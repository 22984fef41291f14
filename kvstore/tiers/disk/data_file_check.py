"""Is ``data.mdb`` whole enough to map? A check with plain reads, before LMDB touches the file.

LMDB maps ``data.mdb`` and trusts it: if the file was cut short (a bad copy, a full disk during ``cp``, a
truncation by hand), the first read of a page past the end is a SIGBUS that kills the process with no message --
in ``kvstore inspect`` as much as in ``kvstore serve``. Its two meta pages (pages 0 and 1) say how long the file
must be: the newer meta (larger transaction id) names the last page in use. Reading them with ``pread`` costs
two small reads and no mapping.

Meta page layout (lmdb.h / mdb.c, native byte order): a 16-byte page header, then ``mm_magic`` (u32,
``0xBEEFC0DE``), ``mm_version`` (u32), ``mm_address``, ``mm_mapsize``, two 48-byte ``MDB_db`` records (the first's
``md_pad`` is the page size), ``mm_last_pg`` (u64) and ``mm_txnid`` (u64). A meta page has no checksum, so a
flipped bit there is told apart from a truncation by LMDB's own invariant: the last page lies inside the map.
"""

from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import StorageError

__all__ = ["DATA_FILE", "DataFileDamage", "check_data_file", "data_file_damage"]

DATA_FILE = "data.mdb"
"""LMDB's data file in a data dir (``subdir=True``)."""

_MAGIC = 0xBEEFC0DE
_MAGIC_OFFSET = 16
_MAP_SIZE_OFFSET = 32
_PAGE_SIZE_OFFSET = 40
_LAST_PAGE_OFFSET = 136
_META_BYTES = 152
_RETRY_S = 0.02
_ADVICE = "restore the data dir from a copy, or move it aside and start an empty one (the cache refills)"


@dataclass(frozen=True, slots=True)
class _Meta:
    index: int  # meta page 0 or 1
    map_size: int
    page_size: int
    last_page: int
    txn_id: int


@dataclass(frozen=True, slots=True)
class DataFileDamage:
    """What is wrong with a ``data.mdb`` (``reason``: one line, no advice)."""

    path: Path
    reason: str

    def message(self) -> str:
        return f"{self.path} is damaged: {self.reason}; {_ADVICE}"


def check_data_file(path: Path) -> None:
    """Raise when ``path`` (a ``data.mdb``) exists but cannot be mapped safely; a missing file is a new dir.

    Raises:
        StorageError: empty, not an LMDB file, or shorter than its last commit (the message says what to do).
    """
    damage = data_file_damage(path)
    if damage is not None:
        time.sleep(_RETRY_S)  # a live writer's meta page may have been read mid-write: look once more
        damage = data_file_damage(path)
    if damage is not None:
        raise StorageError(damage.message())


def data_file_damage(path: Path) -> DataFileDamage | None:
    """What is wrong with ``path``, or ``None`` when it is whole (or does not exist)."""
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            first = os.pread(handle.fileno(), _META_BYTES, 0)
            if size == 0:
                return DataFileDamage(path, "it is empty (0 bytes) although LMDB writes two meta pages at creation")
            meta0 = _parse_meta(first, 0)
            if meta0 is None:
                return DataFileDamage(path, f"it is not an LMDB data file ({size:,} bytes, no LMDB meta page)")
            if size < 2 * meta0.page_size:
                return DataFileDamage(path, f"it is {size:,} bytes, shorter than its two meta pages")
            meta1 = _parse_meta(os.pread(handle.fileno(), _META_BYTES, meta0.page_size), 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return DataFileDamage(path, f"it cannot be read ({exc.strerror})")
    newest = max((meta for meta in (meta0, meta1) if meta is not None), key=lambda meta: meta.txn_id)
    needed = (newest.last_page + 1) * newest.page_size
    if needed > newest.map_size:  # LMDB never uses a page past its map: the meta page itself is damaged
        return DataFileDamage(
            path,
            f"its meta page {newest.index} (at byte {newest.index * newest.page_size:,}, transaction "
            f"{newest.txn_id}) is damaged: it names page "
            f"{newest.last_page:,}, past its own map size of {newest.map_size:,} bytes",
        )
    if size < needed:
        return DataFileDamage(
            path,
            f"it is truncated: {size:,} bytes, but its last commit (transaction {newest.txn_id}) needs {needed:,}",
        )
    return None


def _parse_meta(raw: bytes, index: int) -> _Meta | None:
    if len(raw) < _META_BYTES:
        return None
    (magic,) = struct.unpack_from("=I", raw, _MAGIC_OFFSET)
    (map_size,) = struct.unpack_from("=Q", raw, _MAP_SIZE_OFFSET)
    (page_size,) = struct.unpack_from("=I", raw, _PAGE_SIZE_OFFSET)
    last_page, txn_id = struct.unpack_from("=QQ", raw, _LAST_PAGE_OFFSET)
    if magic != _MAGIC or page_size < 512 or page_size & (page_size - 1):
        return None
    return _Meta(index=index, map_size=map_size, page_size=page_size, last_page=last_page, txn_id=txn_id)
