"""The one-writer lock of a data dir, held on the directory itself.

A writable open of a data dir takes ``flock(LOCK_EX | LOCK_NB)`` on the directory's own descriptor and writes its
pid to ``LOCK`` for the messages of anyone refused. The lock is on the directory, not on ``LOCK``, because a file
can be deleted while held: a second process would then create a new ``LOCK``, lock that, and write into the same
LMDB files as the first (two writers corrupt LMDB). A directory cannot be swapped under its open descriptor that
way; removing it means removing the data with it. ``LOCK`` is only a note saying who holds the dir.

No lmdb import: an engine process (the vLLM connector waiting for its embedded server to let go of a dir) uses
``wait_until_unheld`` without loading the disk tier.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from kvstore.errors import StorageError

__all__ = ["OWNER_NOTE_FILE", "holder_of", "release_owner_lock", "take_owner_lock", "wait_until_unheld"]

OWNER_NOTE_FILE = "LOCK"
"""Holds the pid of the process that has the data dir open for writing (a note; the lock is on the dir)."""


def take_owner_lock(path: Path) -> int:
    """Hold the data dir ``path`` exclusively for this process; returns the descriptor to release.

    Raises:
        StorageError: another open (in this process or another) holds it; the message names the holder's pid.
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        holder = holder_of(path)
        if holder == str(os.getpid()):
            raise StorageError(
                f"data dir {path} is held by this process (pid {holder}): a DiskTier on it is already open; "
                "close it first or share it"
            ) from None
        who = f"process {holder}" if holder != "unknown" else f"another process (its note {OWNER_NOTE_FILE} is gone)"
        raise StorageError(
            f"data dir {path} is held by {who}; stop it, open the dir read-only (kvstore inspect), or use another "
            "--data-dir"
        ) from None
    try:
        note = os.open(path / OWNER_NOTE_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            os.write(note, f"{os.getpid()}\n".encode())
        finally:
            os.close(note)
    except OSError as exc:
        os.close(fd)
        raise StorageError(f"cannot write {path / OWNER_NOTE_FILE}: {exc.strerror}; is the data dir writable?") from exc
    return fd


def release_owner_lock(fd: int) -> None:
    """Let go of a lock from ``take_owner_lock`` (closing the descriptor releases the flock)."""
    os.close(fd)


def holder_of(path: Path) -> str:
    """The pid in the data dir's owner note, or ``"unknown"``."""
    try:
        return (path / OWNER_NOTE_FILE).read_text("ascii", "replace").strip() or "unknown"
    except OSError:
        return "unknown"


def wait_until_unheld(path: Path, deadline: float, poll_s: float = 0.05) -> str | None:
    """Wait until no process holds the data dir ``path`` (or it does not exist); returns ``None`` then, or the
    holder's pid when ``deadline`` (``time.monotonic``) passes first."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                if time.monotonic() >= deadline:
                    return holder_of(path)
                time.sleep(poll_s)
                continue
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
    finally:
        os.close(fd)
