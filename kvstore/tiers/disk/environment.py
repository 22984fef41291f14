"""The LMDB environment of one data dir: flags, exclusive ownership, the layout record, safe map growth.

A data dir holds ``data.mdb`` and ``lock.mdb`` (LMDB's) and ``LOCK`` (ours). A writable open holds the dir's
owner lock (``owner_lock``: a flock on the directory, its pid noted in ``LOCK``), so a second writer -- in this
process or another -- fails at once with the holder's pid instead of corrupting the cache. A read-only open
(``kvstore inspect``) takes no lock; it uses LMDB's own reader table, which is safe next to a live writer.
Before LMDB maps ``data.mdb``, ``data_file_check`` reads its meta pages with plain reads: a file cut shorter than
its last commit would be a SIGBUS at the first touch of the map, so it is refused with one line instead. LMDB
cannot open one environment twice in one process, so a read-only open next to a writable one must come from
another process.

LMDB settings follow the measured pitfalls (docs/design-notes.md): ``writemap=False`` (faster for multi-MiB
values, and the file grows only as pages are written), ``sync=False, metasync=False`` (commits go to the page
cache; ``sync()`` makes them durable at batch boundaries), ``readahead=True`` (cold reads collapse without it;
measured: docs/design-notes.md#tiers-disk-environment).

Every lmdb error is translated here (or by callers through ``storage_error``) into ``StorageError``; only
``MapFullError`` leaves ``write()`` as it is, for the writer to handle. ``start_writeback`` asks the kernel to
write dirty pages early (``sync_file_range``) and ``tune_malloc_for_large_values`` keeps glibc from unmapping
LMDB's per-value buffers after each commit: both measured, both Linux/glibc-only and harmless elsewhere.

Threads: read transactions may be opened from any thread through ``read()``; write transactions (besides the
layout record and the removal of unfinished chunks at open), ``start_writeback`` and ``grow_map`` only from
the disk writer thread.
``_gate`` is a readers-writer gate: ``grow_map`` (``mdb_env_set_mapsize`` remaps the file) waits until no read
transaction of this process is open and holds new ones back meanwhile.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from kvstore.chunking import Chunking, parse_chunking
from kvstore.data_dir.owner_lock import release_owner_lock, take_owner_lock
from kvstore.data_dir.server_record import live_server_record
from kvstore.errors import ConfigError, LayoutMismatchError, StorageError
from kvstore.layout import KVLayout
from kvstore.tiers.disk.data_file_check import DATA_FILE, DataFileDamage, check_data_file
from kvstore.tiers.disk.format import (
    DATA_DIR_FORMAT_VERSION,
    INFO_CAPACITY_BYTES,
    INFO_CHUNK_SIZE,
    INFO_CHUNKING,
    INFO_FORMAT_VERSION,
    INFO_LAYOUT,
)

__all__ = [
    "PAGE_DAMAGE",
    "DataDirInfo",
    "DiskEnvironment",
    "storage_error",
    "tune_malloc_for_large_values",
]

logger = logging.getLogger(__name__)

_MAX_DBS = 4
_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start writeback of dirty pages, do not wait
_M_TRIM_THRESHOLD = -1  # glibc mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's largest accepted value on 64-bit
_TRIM_THRESHOLD_BYTES = 256 * 2**20


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """glibc's ``sync_file_range`` (non-blocking writeback), or ``None`` where the C library has none."""
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def tune_malloc_for_large_values() -> bool:
    """Keep glibc from handing multi-MiB buffers back to the kernel after every LMDB commit.

    With ``writemap=False`` LMDB mallocs one buffer per large value it writes and frees them all at commit;
    glibc then trims the heap (or unmaps), so the next group commit page-faults fresh memory and LMDB writes
    slow down several-fold (measured: docs/design-notes.md#tiers-disk-environment).
    Fixing the mmap threshold at 32 MiB and the trim threshold at 256 MiB keeps that memory for reuse. This
    changes the process's allocator settings (what the measured pitfalls recommend doing at start-up);
    ``DiskTuning.tune_malloc`` turns it off.

    Returns:
        ``True`` when glibc accepted both settings (``False`` on other C libraries).
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES)
    )


PAGE_DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.BadTxnError)
"""What LMDB raises on reaching a damaged page (a flipped bit in a page header or a child pointer); a read
transaction that hit one is invalid afterwards, and its next call raises ``BadTxnError``."""


def storage_error(action: str, exc: lmdb.Error) -> StorageError:
    """A ``StorageError`` for a failed lmdb call, naming what was being done (raise it ``from exc``)."""
    if isinstance(exc, PAGE_DAMAGE):
        return StorageError(f"{action}: {DataFileDamage(Path(DATA_FILE), f'a page is damaged ({exc})').message()}")
    if isinstance(exc, lmdb.InvalidError):  # check_data_file passed the magics: a tree record of a meta page
        damage = DataFileDamage(Path(DATA_FILE), f"a meta page's tree record is damaged ({exc})")
        return StorageError(f"{action}: {damage.message()}")
    hint = ""
    if isinstance(exc, lmdb.ReadersFullError):
        hint = "; too many concurrent readers: lower the number of threads reading the disk tier"
    elif isinstance(exc, lmdb.DiskError | lmdb.PanicError):
        hint = "; check the disk and its free space, or move the data dir"
    return StorageError(f"{action}: {exc}{hint}")


@dataclass(frozen=True, slots=True, kw_only=True)
class DataDirInfo:
    """What a data dir records about itself at creation (``info`` sub-database)."""

    format_version: int
    layout: KVLayout
    chunk_size: int
    capacity_bytes: int | None
    chunking: Chunking = Chunking.FIXED


class _ReadersGate:
    """Many shared holders (read transactions) or one exclusive holder (a map resize), resizes first."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._num_readers = 0
        self._resizing = False

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._num_readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._num_readers -= 1
                if self._num_readers == 0:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._resizing = True
            while self._num_readers:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._resizing = False
                self._cond.notify_all()


class DiskEnvironment:
    """One data dir's LMDB environment and its sub-databases (see ``format``).

    Args:
        path: the data dir (created when writable and missing).
        read_only: open without the owner lock and refuse writes.
        map_size_bytes: initial LMDB map size (virtual address space; the file grows only as data is written).
        max_readers: concurrent read transactions allowed (one per ``get_into`` in flight).

    Raises:
        StorageError: the dir cannot be created or opened, is held by another writer, or (read-only) holds no
            data dir.
    """

    def __init__(self, path: Path, *, read_only: bool, map_size_bytes: int, max_readers: int = 256) -> None:
        self.path = Path(path)
        self.read_only = read_only
        self._gate = _ReadersGate()
        self._lock_fd: int | None = None
        self._writeback_fd: int | None = None
        self._sync_file_range: Callable[[int, int, int, int], int] | None = None
        if read_only:
            if not (self.path / DATA_FILE).is_file():
                raise StorageError(f"no kvstore data dir at {self.path} (no {DATA_FILE}); check the --data-dir")
            check_data_file(self.path / DATA_FILE)
        else:
            _make_data_dir(self.path)
            check_data_file(self.path / DATA_FILE)  # before the lock: nothing is written to a damaged dir
            self._lock_fd = take_owner_lock(self.path)
            self._refuse_a_served_dir()
        try:
            self.env = lmdb.open(
                str(self.path),
                map_size=map_size_bytes,
                subdir=True,
                readonly=read_only,
                create=not read_only,
                metasync=False,
                sync=False,
                readahead=True,
                writemap=False,
                max_dbs=_MAX_DBS,
                max_readers=max_readers,
                lock=True,
            )
        except lmdb.Error as exc:
            self._release_owner_lock()
            if "already open in this process" in str(exc):
                raise StorageError(
                    f"data dir {self.path} is already open in this process; use that DiskTier, or open it "
                    "read-only from another process (kvstore inspect)"
                ) from exc
            raise storage_error(f"cannot open data dir {self.path}", exc) from exc
        if not read_only:
            self._writeback_fd = os.open(self.path / DATA_FILE, os.O_RDONLY | os.O_CLOEXEC)
            self._sync_file_range = _sync_file_range()
        try:
            self.payload_db = self.env.open_db(b"payload", create=not read_only)
            self.meta_db = self.env.open_db(b"meta", create=not read_only)
            self.info_db = self.env.open_db(b"info", create=not read_only)
            # read-only opens skip it: unfinished chunks have no meta, so readers never see them
            self.intent_db = None if read_only else self.env.open_db(b"intent", create=True)
        except PAGE_DAMAGE as exc:  # the sub-databases' names live in the main tree: a damaged page of it
            self.close()
            damage = DataFileDamage(self.path / DATA_FILE, f"a page of its main tree is damaged ({exc})")
            raise StorageError(damage.message()) from exc
        except lmdb.Error as exc:
            self.close()
            raise StorageError(
                f"{self.path} is not a kvstore data dir (missing sub-databases: {exc}); check the --data-dir"
            ) from exc

    # -- the layout record -----------------------------------------------------------------------------------

    def _refuse_a_served_dir(self) -> None:
        """Let go of the dir when a live ``kvstore serve`` of another process recorded itself there.

        A server opens its data dir when its first client names the layout (or at start with ``--layout``), so
        until then the dir's lock is free: a second writer would take it, and the server would then refuse every
        client. Refused here instead, naming the server to connect to.

        Raises:
            StorageError: another process serves the dir.
        """
        record = live_server_record(self.path)
        if record is None or record.pid == os.getpid():
            return
        self._release_owner_lock()
        raise StorageError(
            f"data dir {self.path} is served by kvstore serve (pid {record.pid}) at {record.url}; use "
            f"kvstore.Client({record.url!r}, layout), stop that server, or use another data dir"
        )

    def read_info(self) -> DataDirInfo | None:
        """The data dir's record of itself, or ``None`` for a fresh dir.

        Raises:
            StorageError: the record is there but unreadable: LMDB keeps no checksum of values, so a flipped bit
                in it is damage to name, not a bad layout or setting of the caller's
                (``tests/integration/test_damaged_data_dir.py``).
        """
        with self.read() as txn:
            names = (INFO_FORMAT_VERSION, INFO_LAYOUT, INFO_CHUNK_SIZE)
            raw = {name: txn.get(name, db=self.info_db) for name in names}
            capacity = txn.get(INFO_CAPACITY_BYTES, db=self.info_db)
            chunking = txn.get(INFO_CHUNKING, db=self.info_db)
            if any(value is None for value in raw.values()):
                return None
            values = {name: bytes(value) for name, value in raw.items() if value is not None}
            capacity_value = bytes(capacity) if capacity is not None else None
            chunking_value = bytes(chunking).decode("utf-8") if chunking is not None else Chunking.FIXED.value
        try:
            return DataDirInfo(
                format_version=int(values[INFO_FORMAT_VERSION]),
                layout=KVLayout.from_json(values[INFO_LAYOUT].decode("utf-8")),
                chunk_size=int(values[INFO_CHUNK_SIZE]),
                capacity_bytes=int(capacity_value) if capacity_value is not None else None,
                chunking=parse_chunking(chunking_value),
            )
        except (ValueError, ConfigError) as exc:  # UnicodeDecodeError is a ValueError
            reason = f"its info record (layout, chunk size, capacity) is unreadable ({exc})"
            damage = DataFileDamage(self.path / DATA_FILE, reason)
            raise StorageError(damage.message()) from exc

    def check_info(
        self, layout: KVLayout, chunk_size: int, capacity_bytes: int, chunking: Chunking = Chunking.FIXED
    ) -> None:
        """Record the layout in a fresh dir, or check that an existing dir holds this layout and chunk size, and
        (a writable open) was cut by this rule: its chunks' keys name their cut, so a store cutting prompts another
        way would find almost none of them, and its rebuilt index would hold chunks its prompts never cut into.

        Raises:
            LayoutMismatchError: the dir holds KV of another layout or chunk size, or cut by another rule.
            StorageError: the dir was written by a newer kvstore, or is empty and read-only.
        """
        info = self.read_info()
        if info is None:
            if self.read_only:
                raise StorageError(f"data dir {self.path} is empty (no layout recorded); nothing to read")
            with self.write() as txn:
                txn.put(INFO_FORMAT_VERSION, str(DATA_DIR_FORMAT_VERSION).encode(), db=self.info_db)
                txn.put(INFO_LAYOUT, layout.to_json().encode(), db=self.info_db)
                txn.put(INFO_CHUNK_SIZE, str(chunk_size).encode(), db=self.info_db)
                txn.put(INFO_CHUNKING, Chunking(chunking).value.encode(), db=self.info_db)
                txn.put(INFO_CAPACITY_BYTES, str(capacity_bytes).encode(), db=self.info_db)
            return
        if info.format_version > DATA_DIR_FORMAT_VERSION:
            raise StorageError(
                f"data dir {self.path} has format version {info.format_version}, newer than this kvstore "
                f"(version {DATA_DIR_FORMAT_VERSION}); upgrade kvstore or use another data dir"
            )
        if info.layout.to_json() != layout.to_json() or info.chunk_size != chunk_size:
            raise LayoutMismatchError(
                f"data dir {self.path} holds KV of {info.layout.describe()} "
                f"with chunk_size={info.chunk_size}, "
                f"but it was opened for {layout.describe()} with chunk_size={chunk_size}; open it with the "
                "model and --chunk-size it was created with, or use another --data-dir (or delete this dir)"
            )
        if not self.read_only and info.chunking != chunking:
            raise LayoutMismatchError(
                f"data dir {self.path} holds chunks cut by --chunking {info.chunking.value}, but it was opened "
                f"with --chunking {Chunking(chunking).value}; pass --chunking {info.chunking.value} or use another "
                "--data-dir"
            )
        if not self.read_only and info.capacity_bytes != capacity_bytes:
            with self.write() as txn:
                txn.put(INFO_CAPACITY_BYTES, str(capacity_bytes).encode(), db=self.info_db)

    # -- transactions ----------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def read(self) -> Iterator[lmdb.Transaction[memoryview]]:
        """A read transaction whose values are memoryviews into the map, valid until the block ends."""
        with self._read(buffers=True) as txn:
            yield txn

    @contextlib.contextmanager
    def read_copies(self) -> Iterator[lmdb.Transaction[bytes]]:
        """A read transaction whose values are copied out as ``bytes``: for passes that keep thousands of records at
        once (a batch decoded as arrays). py-lmdb makes a kept memoryview several times slower than a copy of a
        meta record (measured: 100,000 records listed in 0.39 s as views, 0.16 s as copies)."""
        with self._read(buffers=False) as txn:
            yield txn

    @contextlib.contextmanager
    def _read(self, *, buffers: bool) -> Iterator[lmdb.Transaction[Any]]:
        for _ in range(2):
            with self._gate.shared():
                try:
                    txn = self.env.begin(buffers=True) if buffers else self.env.begin()
                except lmdb.MapResizedError:
                    txn = None
                except lmdb.Error as exc:
                    raise storage_error(f"cannot read data dir {self.path}", exc) from exc
                if txn is not None:
                    try:
                        yield txn
                    except lmdb.Error as exc:
                        raise storage_error(f"cannot read data dir {self.path}", exc) from exc
                    finally:
                        txn.abort()
                    return
            with self._gate.exclusive():  # another process grew the map: adopt its size
                self.env.set_mapsize(0)
        raise StorageError(f"data dir {self.path} keeps being resized by another process; retry")

    @contextlib.contextmanager
    def write(self) -> Iterator[lmdb.Transaction[bytes]]:
        """A write transaction, committed when the block ends without an exception and aborted otherwise.

        Raises:
            lmdb.MapFullError: the map is full (left untranslated: the writer grows the map or evicts).
            StorageError: any other lmdb failure.
        """
        try:
            txn = self.env.begin(write=True)
            try:
                yield txn
            except BaseException:
                txn.abort()
                raise
            txn.commit()
        except lmdb.MapFullError:
            raise
        except lmdb.Error as exc:
            raise storage_error(f"cannot write data dir {self.path}", exc) from exc

    def writable_intent_db(self) -> lmdb._Database:
        """The ``intent`` sub-database (writable opens only)."""
        assert self.intent_db is not None, f"intent records of {self.path} used on a read-only open: writer wiring"
        return self.intent_db

    # -- map and file ----------------------------------------------------------------------------------------

    @property
    def map_size_bytes(self) -> int:
        return int(self.env.info()["map_size"])

    def grow_map(self, map_size_bytes: int) -> None:
        """Enlarge the map (writer thread, no write transaction open); waits for this process's readers."""
        with self._gate.exclusive():
            self.env.set_mapsize(map_size_bytes)
        logger.info("disk tier %s: map grown to %.1f MiB", self.path, map_size_bytes / 2**20)

    def file_bytes(self) -> int:
        """Current size of ``data.mdb`` on disk."""
        return (self.path / DATA_FILE).stat().st_size

    def sync(self) -> None:
        """Make every commit durable (fdatasync of the data file)."""
        self.env.sync(True)

    def start_writeback(self) -> None:
        """Start writing the data file's dirty pages to disk without waiting for them (Linux; else a no-op).

        Not a durability promise (``sync`` is): it keeps the disk busy while the codec works, so the next
        ``sync`` waits only for the tail instead of everything written since the last one.
        """
        if self._writeback_fd is not None and self._sync_file_range is not None:
            self._sync_file_range(self._writeback_fd, 0, 0, _SYNC_FILE_RANGE_WRITE)

    def close(self) -> None:
        """Close the environment and release the owner lock. Idempotent."""
        self.env.close()
        if self._writeback_fd is not None:
            os.close(self._writeback_fd)
            self._writeback_fd = None
        self._release_owner_lock()

    def _release_owner_lock(self) -> None:
        if self._lock_fd is not None:
            release_owner_lock(self._lock_fd)
            self._lock_fd = None


def _make_data_dir(path: Path) -> None:
    """Create the data dir (and parents) or say in one line why it cannot be."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise StorageError(f"data dir {path} exists and is not a directory; choose another --data-dir") from None
    except OSError as exc:
        raise StorageError(f"cannot create data dir {path}: {exc.strerror}; choose a writable --data-dir") from None
    if not path.is_dir():
        raise StorageError(f"data dir {path} is not a directory; choose another --data-dir")
