"""An arena's bytes in a sealed memory file, so that clients on the same host can read chunks where the tier keeps
them (a lent retrieve: ``TieredStore.lend``) instead of having the server copy them out first.

Why: a tensor-parallel engine's ranks each load their KV heads of every chunk of a hit. Copied by the server into
each rank's buffer, that copy sat on the engine's path for as long as the rank's own copy into vLLM's blocks
(31-37 ms against 18-20 ms a rank at TP=2 for a 4,000-token prompt; docs/design-notes.md "A hit's time at TP=2").
Mapped by the rank, the rank's one copy reads straight from the slot.

The file is a ``memfd`` named ``kvstore-arena-<pid>-<16 hex>`` (no path, so nothing is left behind when the server
dies), sealed against shrinking and growing, so a client's mapping can never fault on a truncated file. The server
keeps the descriptor open for the tier's life; a client opens it through ``/proc/<server pid>/fd/<fd>`` read-only
(``kvstore.wire.shm.map_lent_arena``), so no client can write the store's memory. Its pages are taken on first
touch, as an anonymous arena's are.
"""

from __future__ import annotations

import fcntl
import os
import secrets
from dataclasses import dataclass

import torch

from kvstore.errors import StorageError

__all__ = ["ARENA_NAME_PREFIX", "SealedMemfd", "create_sealed_memfd", "create_shared_arena", "memfd_possible"]

ARENA_NAME_PREFIX = "kvstore-arena-"
"""Every shared arena's memfd name begins so, then ``<pid>-<16 hex>``: a client checks it maps the server's."""


def memfd_possible() -> bool:
    """Whether this host can share memory files: Linux ``memfd_create`` and a ``/proc`` to open another process's."""
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


@dataclass(slots=True)
class SealedMemfd:
    """A memory file this process made and maps: ``tensor`` is its bytes (``uint8``, ``nbytes`` long). ``fd`` stays
    open until the other side has opened it (``close_fd``); the mapping outlives it."""

    name: str
    nbytes: int
    fd: int | None
    tensor: torch.Tensor

    def close_fd(self) -> None:
        """Close the descriptor (idempotent): nobody new can open the file; existing mappings stay valid."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def create_sealed_memfd(name: str, nbytes: int, *, reserve: bool) -> SealedMemfd:
    """Create a memfd of ``nbytes`` called ``name``, seal it against shrinking and growing, and map it; with
    ``reserve`` its pages are allocated now (``posix_fallocate``: short memory is this error, not a later SIGBUS),
    else as they are first written.

    Raises:
        StorageError: this OS has no sealed memfds, or the file could not be made, reserved or mapped.
    """
    if not memfd_possible():
        raise StorageError("shared memory needs Linux memfd_create and /proc")
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        if reserve:
            os.posix_fallocate(fd, 0, nbytes)
        else:
            os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        tensor = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)
    except (OSError, RuntimeError) as exc:
        os.close(fd)
        reason = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise StorageError(f"cannot reserve a {nbytes / 2**20:.1f} MiB shared-memory file: {reason}") from exc
    return SealedMemfd(name=name, nbytes=nbytes, fd=fd, tensor=tensor)


def create_shared_arena(nbytes: int) -> SealedMemfd:
    """An arena's memory file (``kvstore-arena-<pid>-<16 hex>``), its pages taken on first write as an anonymous
    arena's are; the tier keeps ``fd`` open for clients until it closes.

    Raises:
        StorageError: as ``create_sealed_memfd``.
    """
    return create_sealed_memfd(f"{ARENA_NAME_PREFIX}{os.getpid()}-{secrets.token_hex(8)}", nbytes, reserve=False)
