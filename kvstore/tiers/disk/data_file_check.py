"""Is ``data.mdb`` whole enough to map? A check with plain reads, before LMDB touches the file.

LMDB maps ``data.mdb`` and trusts it: if the file was cut short (a bad copy, a full disk during ``cp``, a
truncation by hand), the first read of a page past the end is a SIGBUS that kills the process with no message --
in ``kvstore inspect`` as much as in ``kvstore serve``. Its two meta pages (pages 0 and 1) say how long the file
must be: the newer meta (larger transaction id) names the last page in use. Reading them with ``pread`` costs
two small reads and no mapping.

Meta page layout (lmdb.h / mdb.c, native byte order): a 16-byte page header, then ``mm_magic`` (u32,
``0xBEEFC0DE``), ``mm_version`` (u32), ``mm_address``, ``mm_mapsize``, two 48-byte ``MDB_db`` records (the first's
``md_pad`` is the page size), ``mm_last_pg`` (u64) and ``mm_txnid`` (u64). A meta page has no checksum, so a
flipped bit there is told apart from a truncation by what LMDB itself requires of both metas at open (the page
header's meta flag, the magic, data format version 1) and by its invariant that the last page lies inside the map;
a last page one bit away from the file's own is named as a likely flipped bit, so that the message points at damage
rather than at a short copy. Last, every value of the newest commit's trees must lie inside the file
(``value_extents``).
"""

from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import StorageError
from kvstore.tiers.disk.value_extents import value_past_end

__all__ = ["DATA_FILE", "DataFileDamage", "check_data_file", "data_file_damage"]

DATA_FILE = "data.mdb"
"""LMDB's data file in a data dir (``subdir=True``)."""

_MAGIC = 0xBEEFC0DE
_DATA_VERSION = 1  # MDB_DATA_VERSION
_PAGE_FLAGS_OFFSET = 10
_META_FLAG = 0x08  # P_META
_MAGIC_OFFSET = 16
_MAP_SIZE_OFFSET = 32
_PAGE_SIZE_OFFSET = 40
_MAIN_ROOT_OFFSET = 128
_LAST_PAGE_OFFSET = 136
_META_BYTES = 152
_COMMON_PAGE_BYTES = 4096  # LMDB's page size is the OS page's: where meta page 1 is when meta page 0 cannot say
_BAD_MAGIC = "its magic is"
_RETRY_S = 0.02
_ADVICE = "restore the data dir from a copy, or move it aside and start an empty one (the cache refills)"


@dataclass(frozen=True, slots=True)
class _Meta:
    index: int  # meta page 0 or 1
    map_size: int
    page_size: int
    last_page: int
    txn_id: int
    main_root: int  # the main tree's root page (the sub-databases' records)


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
            if isinstance(meta0, str):  # with a good magic, or a good meta page 1, it is LMDB's file, damaged
                second = _parse_meta(os.pread(handle.fileno(), _META_BYTES, _COMMON_PAGE_BYTES), 1)
                if meta0.startswith(_BAD_MAGIC) and not isinstance(second, _Meta):
                    return DataFileDamage(path, f"it is not an LMDB data file ({size:,} bytes, no LMDB meta page)")
                return DataFileDamage(path, f"its meta page 0 (at byte 0) is damaged: {meta0}")
            if size < 2 * meta0.page_size:
                return DataFileDamage(path, f"it is {size:,} bytes, shorter than its two meta pages")
            meta1 = _parse_meta(os.pread(handle.fileno(), _META_BYTES, meta0.page_size), 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return DataFileDamage(path, f"it cannot be read ({exc.strerror})")
    if isinstance(meta1, str):  # LMDB refuses to open with either meta damaged
        return DataFileDamage(path, f"its meta page 1 (at byte {meta0.page_size:,}) is damaged: {meta1}")
    newest = max((meta0, meta1), key=lambda meta: meta.txn_id)
    needed = (newest.last_page + 1) * newest.page_size
    if needed > newest.map_size:  # LMDB never uses a page past its map: the meta page itself is damaged
        return DataFileDamage(
            path,
            f"its meta page {newest.index} (at byte {newest.index * newest.page_size:,}, transaction "
            f"{newest.txn_id}) is damaged: it names page "
            f"{newest.last_page:,}, past its own map size of {newest.map_size:,} bytes",
        )
    if size < needed:
        num_pages = size // newest.page_size
        flipped = (num_pages - 1) ^ newest.last_page
        likely = (
            f"; the file's last page ({num_pages - 1:,}) and the one its meta page {newest.index} names differ in "
            "one bit: more likely a flipped bit in that meta page than a cut file"
            if size % newest.page_size == 0 and flipped & (flipped - 1) == 0
            else ""
        )
        return DataFileDamage(
            path,
            f"it is truncated: {size:,} bytes, but its last commit (transaction {newest.txn_id}) needs "
            f"{needed:,}{likely}",
        )
    return _tree_damage(path, newest)


def _tree_damage(path: Path, newest: _Meta) -> DataFileDamage | None:
    """A value of the newest commit's trees that runs past the file (a read of it would be a SIGBUS)."""
    try:
        with open(path, "rb") as handle:
            past_end = value_past_end(handle.fileno(), newest.page_size, newest.last_page, newest.main_root)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return DataFileDamage(path, f"it cannot be read ({exc.strerror})")
    return DataFileDamage(path, f"a tree page is damaged: {past_end}") if past_end is not None else None


def _parse_meta(raw: bytes, index: int) -> _Meta | str:
    """Meta page ``index``, or what is wrong with it (one line) where LMDB would refuse it."""
    if len(raw) < _META_BYTES:
        return f"the file ends inside it ({len(raw)} of its first {_META_BYTES} bytes)"
    (flags,) = struct.unpack_from("=H", raw, _PAGE_FLAGS_OFFSET)
    magic, version = struct.unpack_from("=II", raw, _MAGIC_OFFSET)
    (map_size,) = struct.unpack_from("=Q", raw, _MAP_SIZE_OFFSET)
    (page_size,) = struct.unpack_from("=I", raw, _PAGE_SIZE_OFFSET)
    (main_root,) = struct.unpack_from("=Q", raw, _MAIN_ROOT_OFFSET)
    last_page, txn_id = struct.unpack_from("=QQ", raw, _LAST_PAGE_OFFSET)
    if magic != _MAGIC:
        return f"{_BAD_MAGIC} {magic:#010x}, not LMDB's {_MAGIC:#010x}"
    if not flags & _META_FLAG:
        return f"its page header's flags ({flags:#06x}) do not mark a meta page"
    if version != _DATA_VERSION:
        return f"its data format version is {version}, LMDB writes {_DATA_VERSION}"
    if page_size < 512 or page_size & (page_size - 1):
        return f"its page size is {page_size:,}, not a power of two of at least 512"
    return _Meta(
        index=index, map_size=map_size, page_size=page_size, last_page=last_page, txn_id=txn_id, main_root=main_root
    )
