"""Shared-memory segments for bulk KV between a client and a server on the same host.

A segment is a file in ``/dev/shm`` (tmpfs) that both processes map with ``MAP_SHARED`` (``torch.from_file``), so a
store reads the client's KV where the client put it and a retrieve writes KV where the client will read it: no
copy beyond the tier's own. Its life, which leaves no file behind on any path::

    client: create kvstore-<pid>-<random> (O_EXCL, 0600), reserve its pages (posix_fallocate), map it
    client -> server: attach(name, nbytes)
    server: check name/owner/size, map it, unlink the name          <- from here no name exists
    client: unlink the name too (idempotent), whatever the reply    <- covers a failed attach
    ... both use their mappings; the memory goes when the last mapping goes (either side may die first) ...

Only a client killed between ``create`` and the attach reply leaves a name; ``sweep_stale_segments`` (run by the
server at start-up and periodically, and by each new client) unlinks segments whose creator pid is dead.

Reserving the pages up front matters: a write to an unbacked page of a full tmpfs is a SIGBUS, which would kill
whichever process touched it first -- possibly the server. ``posix_fallocate`` fails cleanly (ENOSPC) instead, and
the client falls back to inline bytes.

Pure functions over the filesystem; thread-safe.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstore.errors import StorageError
from kvstore.server.errors import ErrorCode, RequestError

__all__ = [
    "SHM_DIR",
    "OwnedSegment",
    "create_segment",
    "host_id",
    "open_segment",
    "pid_alive",
    "segment_owner_pid",
    "shm_available",
    "sweep_stale_segments",
    "unlink_segment",
]

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
_NAME_PATTERN = re.compile(r"kvstore-([0-9]{1,10})-[0-9a-f]{16}")


def shm_available(directory: Path = SHM_DIR) -> bool:
    """Whether this host has a writable tmpfs for segments (Linux: ``/dev/shm``)."""
    return directory.is_dir() and os.access(directory, os.W_OK | os.X_OK)


def host_id() -> str:
    """This host's shared-memory namespace: hostname and boot id (Linux). A client whose id equals the server's
    shares its ``/dev/shm``; a container with its own ``/dev/shm`` fails the attach and falls back to inline."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = "no-boot-id"
    return f"{os.uname().nodename}/{boot_id}"


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists and has not exited (it may belong to another user; a zombie, dead
    but not yet reaped by its parent, counts as gone)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no procfs (or it just exited): trust the signal check
    return stat[stat.rfind(")") + 2 :][:1] != "Z"


def segment_owner_pid(name: str) -> int | None:
    """The creator pid encoded in a segment name, or ``None`` when the name is not a kvstore segment's."""
    match = _NAME_PATTERN.fullmatch(name)
    return int(match.group(1)) if match else None


@dataclass(slots=True)
class OwnedSegment:
    """A segment this process created and maps: ``tensor`` is its bytes (``uint8``, ``nbytes`` long)."""

    name: str
    nbytes: int
    tensor: torch.Tensor


def create_segment(nbytes: int, directory: Path = SHM_DIR) -> OwnedSegment:
    """Create, reserve and map a new segment named after this process.

    Raises:
        StorageError: the tmpfs is missing or too full (the caller falls back to inline bytes).
    """
    name = f"kvstore-{os.getpid()}-{secrets.token_hex(8)}"
    path = directory / name
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise StorageError(f"cannot create shared-memory segment {path}: {exc.strerror}") from exc
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        finally:
            os.close(fd)
        tensor = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
    except (OSError, RuntimeError) as exc:
        unlink_segment(name, directory)
        reason = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise StorageError(
            f"cannot reserve a {nbytes / 2**20:.1f} MiB shared-memory segment in {directory}: {reason}"
        ) from exc
    return OwnedSegment(name=name, nbytes=nbytes, tensor=tensor)


def unlink_segment(name: str, directory: Path = SHM_DIR) -> None:
    """Remove a segment's name (mappings stay valid). Idempotent."""
    (directory / name).unlink(missing_ok=True)


def open_segment(name: str, nbytes: int, owner_pid: int, directory: Path = SHM_DIR) -> torch.Tensor:
    """Map a segment a client created, then unlink its name (server side).

    Args:
        name: the segment's file name (``kvstore-<pid>-<16 hex>``), never a path.
        nbytes: the size the client says it has; the file must be exactly that long.
        owner_pid: the client's pid from its hello; the name must carry it, so a client cannot take another's.

    Raises:
        RequestError: ``invalid_argument`` when the name, owner or size is wrong or the file cannot be mapped.
    """
    pid = segment_owner_pid(name)
    if pid is None:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"segment name {name!r:.80} is not kvstore-<pid>-<16 hex>")
    if pid != owner_pid:
        raise RequestError(
            ErrorCode.INVALID_ARGUMENT, f"segment {name} belongs to pid {pid}, not to this client (pid {owner_pid})"
        )
    path = directory / name
    try:
        info = path.lstat()
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise RequestError(
                ErrorCode.INVALID_ARGUMENT, f"segment {name} is not a regular file owned by the server's user"
            )
        if info.st_size != nbytes:
            raise RequestError(
                ErrorCode.INVALID_ARGUMENT, f"segment {name} is {info.st_size} bytes, the client said {nbytes}"
            )
        tensor = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
    except FileNotFoundError:
        raise RequestError(
            ErrorCode.INVALID_ARGUMENT, f"no segment {name} in {directory} (another host, or another /dev/shm?)"
        ) from None
    except (OSError, RuntimeError) as exc:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"cannot map segment {name}: {exc}") from None
    finally:
        unlink_segment(name, directory)
    return tensor


def sweep_stale_segments(directory: Path = SHM_DIR) -> int:
    """Unlink segments whose creator process is gone; returns how many."""
    if not directory.is_dir():
        return 0
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        pid = segment_owner_pid(name)
        if pid is not None and not pid_alive(pid):
            unlink_segment(name, directory)
            removed += 1
    if removed:
        logger.info("removed %d shared-memory segments left by processes that died", removed)
    return removed
