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

__all__ = ["ARENA_NAME_PREFIX", "SharedArena", "create_shared_arena", "shared_arena_possible"]

ARENA_NAME_PREFIX = "kvstore-arena-"
"""Every shared arena's memfd name begins so, then ``<pid>-<16 hex>``: a client checks it maps the server's."""


def shared_arena_possible() -> bool:
    """Whether this host can share an arena: Linux ``memfd_create`` and a ``/proc`` for clients to open it through."""
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


@dataclass(slots=True)
class SharedArena:
    """An arena's memory file: ``tensor`` maps its ``nbytes``; ``fd`` stays open for clients until ``close``."""

    name: str
    nbytes: int
    fd: int | None
    tensor: torch.Tensor

    def close(self) -> None:
        """Close the descriptor (idempotent): no new client can map the file; existing mappings stay valid."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def create_shared_arena(nbytes: int) -> SharedArena:
    """Create, seal and map a memory file of ``nbytes`` for an arena.

    Raises:
        StorageError: this OS has no sealed memfds, or the file could not be made or mapped.
    """
    if not shared_arena_possible():
        raise StorageError("a shared arena needs Linux memfd_create and /proc")
    name = f"{ARENA_NAME_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        tensor = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)
    except (OSError, RuntimeError) as exc:
        os.close(fd)
        reason = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise StorageError(f"cannot make a {nbytes / 2**20:.1f} MiB shared arena: {reason}") from exc
    return SharedArena(name=name, nbytes=nbytes, fd=fd, tensor=tensor)
