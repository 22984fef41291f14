"""Shared-memory segments for bulk KV between a client and a server on the same host.

A segment is an anonymous, sealed memory file (``memfd_create``) that both processes map with ``MAP_SHARED``
(``torch.from_file`` on its ``/proc`` path), so a store reads the client's KV where the client put it and a retrieve
writes KV where the client will read it: no copy beyond the tier's own. Its life::

    client: memfd_create("kvstore-<pid>-<random>"), reserve its pages (posix_fallocate),
            seal it against shrinking and growing (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), map it
    client -> server: attach(name, nbytes, fd)
    server: open /proc/<client pid>/fd/<fd>, check it is that memfd (its name carries the client's random part),
            its size and its seals, map it
    client: close its descriptor, whatever the reply
    ... both use their mappings; the memory goes when the last mapping goes (either side may die first) ...

Why sealed: a mapping whose file shrinks under it raises SIGBUS on the next access, which would kill the server
for something a client did to its own segment. A sealed memfd cannot be truncated by anyone, so the server refuses
any segment without ``F_SEAL_SHRINK``. Why memfd rather than a file in ``/dev/shm``: nothing has a name, so
nothing is left behind when a client dies at any point, and no other process can open it by path.

Reserving the pages up front matters too: a write to an unbacked page when memory is short is a SIGBUS as well;
``posix_fallocate`` fails cleanly (ENOSPC) instead, and the client falls back to inline bytes.

Why only plain memfds (shmem, ``TMPFS_MAGIC``): a memfd made with ``MFD_HUGETLB`` passes every other check, but
its owner can punch a hole in it and use up the host's free huge pages, and the server's next touch of the hole
faults with SIGBUS (a huge page cannot be found, while shmem takes an ordinary page). The filesystem the descriptor
lives on is checked (``fstatfs``), not trusted from the name.

Pure functions over the process's descriptors; thread-safe.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import logging
import mmap
import os
import re
import secrets
import stat
import warnings
from pathlib import Path

import torch

from kvstore.errors import StorageError
from kvstore.tiers.memfd_arena import ARENA_NAME_PREFIX, SealedMemfd, create_sealed_memfd, memfd_possible
from kvstore.wire.error_codes import ErrorCode, RequestError

__all__ = [
    "MappedArena",
    "OwnedSegment",
    "create_segment",
    "host_id",
    "map_lent_arena",
    "open_segment",
    "segment_owner_pid",
    "shm_available",
]

logger = logging.getLogger(__name__)

_NAME_PATTERN = re.compile(r"kvstore-([0-9]{1,10})-[0-9a-f]{16}")
_REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_TMPFS_MAGIC = 0x01021994
"""``statfs.f_type`` of shmem, where a plain memfd lives (linux/magic.h); hugetlbfs is 0x958458F6."""
_STATFS_BYTES = 256  # struct statfs is 120 bytes on 64-bit Linux; f_type (a long) comes first


def host_id() -> str:
    """This host's shared-memory namespace: hostname and boot id (Linux). A client whose id differs from the
    server's never attaches; one in another pid namespace fails the attach and falls back to inline bytes."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = "no-boot-id"
    return f"{os.uname().nodename}/{boot_id}"


def segment_owner_pid(name: str) -> int | None:
    """The creator pid encoded in a segment name, or ``None`` when the name is not a kvstore segment's."""
    match = _NAME_PATTERN.fullmatch(name)
    return int(match.group(1)) if match else None


OwnedSegment = SealedMemfd
"""A segment this process created and maps; ``fd`` stays open until the server has opened it (``close_fd``)."""

shm_available = memfd_possible
"""Whether this host can share segments: Linux ``memfd_create`` and a ``/proc`` to open another process's."""


def create_segment(nbytes: int) -> OwnedSegment:
    """Create, reserve, seal and map a new segment named after this process.

    Raises:
        StorageError: memory is too short to reserve it, or this OS has no sealed memfds (the caller falls back
            to inline bytes).
    """
    return create_sealed_memfd(f"kvstore-{os.getpid()}-{secrets.token_hex(8)}", nbytes, reserve=True)


def open_segment(name: str, nbytes: int, fd: int, owner_pid: int) -> torch.Tensor:
    """Map a segment a client created (server side).

    Args:
        name: the segment's name (``kvstore-<pid>-<16 hex>``); the descriptor must be the memfd of that name.
        nbytes: the size the client says it has; the memfd must be exactly that long.
        fd: the client's descriptor number for it (opened here through ``/proc/<owner_pid>/fd``).
        owner_pid: the client's pid from its hello; the name must carry it, so a client cannot take another's.

    Raises:
        RequestError: ``invalid_argument`` when the name, owner, size or seals are wrong or it cannot be mapped.
    """
    pid = segment_owner_pid(name)
    if pid is None:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"segment name {name!r:.80} is not kvstore-<pid>-<16 hex>")
    if pid != owner_pid:
        raise RequestError(
            ErrorCode.INVALID_ARGUMENT, f"segment {name} belongs to pid {pid}, not to this client (pid {owner_pid})"
        )
    source = f"/proc/{owner_pid}/fd/{fd}"
    try:
        own_fd = os.open(source, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise RequestError(
            ErrorCode.INVALID_ARGUMENT,
            f"cannot open segment {name} at {source} ({exc.strerror}; another host or pid namespace?)",
        ) from None
    try:
        _check_segment(own_fd, name, nbytes)
        return torch.from_file(f"/proc/self/fd/{own_fd}", shared=True, size=nbytes, dtype=torch.uint8)
    except (OSError, RuntimeError) as exc:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"cannot map segment {name}: {exc}") from None
    finally:
        os.close(own_fd)


def _check_segment(fd: int, name: str, nbytes: int) -> None:
    """Refuse a descriptor that is not the named, sealed memfd of ``nbytes`` bytes: anything else could shrink
    under the server's mapping (SIGBUS) or be some other file of the client's."""
    target = os.readlink(f"/proc/self/fd/{fd}")
    if target != f"/memfd:{name} (deleted)":
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"segment {name}: the descriptor is {target!r:.100}, not it")
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size != nbytes:
        raise RequestError(
            ErrorCode.INVALID_ARGUMENT, f"segment {name} is {info.st_size} bytes, the client said {nbytes}"
        )
    filesystem = _filesystem_type(fd)
    if filesystem != _TMPFS_MAGIC:
        raise RequestError(
            ErrorCode.INVALID_ARGUMENT,
            f"segment {name} is not a plain memfd (filesystem type {filesystem:#x}; hugetlb and other memory the "
            "server could fault on are refused)",
        )
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if seals & _REQUIRED_SEALS != _REQUIRED_SEALS:
        raise RequestError(
            ErrorCode.INVALID_ARGUMENT,
            f"segment {name} is not sealed against shrinking and growing (F_SEAL_SHRINK | F_SEAL_GROW)",
        )


def _filesystem_type(fd: int) -> int:
    """``fstatfs(fd).f_type``: Python's ``os`` has no ``fstatfs``, so libc's, through ctypes."""
    buffer = ctypes.create_string_buffer(_STATFS_BYTES)
    if _libc().fstatfs(fd, buffer) != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    return ctypes.c_ulong.from_buffer(buffer).value & 0xFFFFFFFF


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


_MADV_POPULATE_READ = 22
"""``madvise`` advice that maps a range's pages ahead of reading (Linux 5.14; Python 3.11's ``mmap`` lacks the name)."""
_PAGE_BYTES = mmap.PAGESIZE


class MappedArena:
    """A server's shared cpu arena, mapped read-only by this client (``map_lent_arena``).

    A page of a fresh mapping costs a fault on its first read: 44 ms of faults for 64 MiB here, against a 12 ms copy
    (measured; docs/design-notes.md "A hit's time at TP=2"). ``populate`` maps a chunk's pages in one call before its
    first read instead (3.4 ms for 64 MiB), once per chunk slot: slots hold chunks the server has written, so nothing
    is allocated that the server had not. Threads: any (a lost race only populates a range twice).
    """

    def __init__(self, name: str, mapping: mmap.mmap) -> None:
        self.name = name
        self._mapping = mapping
        with warnings.catch_warnings():  # torch warns of every read-only buffer; this one is read-only on purpose
            warnings.simplefilter("ignore", UserWarning)
            self.tensor = torch.frombuffer(mapping, dtype=torch.uint8)
        self._populated: dict[int, int] = {}  # a slot's offset: the bytes mapped from it
        self._can_populate = True

    def populate(self, offset: int, nbytes: int) -> None:
        """Map the pages of ``[offset, offset + nbytes)`` now, unless done before (best effort: a kernel without the
        advice leaves them to fault in as they are read)."""
        if not self._can_populate or self._populated.get(offset, 0) >= nbytes:
            return
        first = offset - offset % _PAGE_BYTES
        try:
            self._mapping.madvise(_MADV_POPULATE_READ, first, offset + nbytes - first)
        except OSError as exc:
            logger.debug("cannot populate the lent arena's pages (%s); they fault in as read", exc)
            self._can_populate = False
            return
        self._populated[offset] = nbytes


def map_lent_arena(name: str, nbytes: int, pid: int, fd: int) -> MappedArena:
    """Map a server's shared cpu arena read-only (client side; ``kvstore.tiers.memfd_arena``): the server lends
    chunks by their offsets in it. Read-only, so nothing a client does can change the store's KV.

    Args:
        name: the arena's memfd name (``kvstore-arena-<pid>-<16 hex>``), which must carry ``pid``.
        nbytes: its size, as the server's hello says.
        pid: the server's pid; fd: its descriptor for the file (opened here through ``/proc/<pid>/fd``).

    Raises:
        StorageError: the name, size, seals or file are not the arena's, or it cannot be opened (another pid
            namespace) or mapped; the client then retrieves as before.
    """
    if not name.startswith(ARENA_NAME_PREFIX) or segment_owner_pid(f"kvstore-{name[len(ARENA_NAME_PREFIX):]}") != pid:
        raise StorageError(f"lent arena name {name!r:.80} is not kvstore-arena-{pid}-<16 hex>")
    source = f"/proc/{pid}/fd/{fd}"
    try:
        own_fd = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise StorageError(f"cannot open the server's arena at {source} ({exc.strerror})") from None
    try:
        _check_segment(own_fd, name, nbytes)
        mapping = mmap.mmap(own_fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    except (OSError, RequestError) as exc:
        raise StorageError(f"cannot map the server's arena {name}: {exc}") from None
    finally:
        os.close(own_fd)
    return MappedArena(name, mapping)
