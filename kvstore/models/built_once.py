"""A model directory under the cache, made once per machine by whichever process asks first.

The model cache holds directories that take tens of seconds to make (the GGUF's converted copy, the vLLM export).
The maker writes into a private directory and renames it into place, so no reader ever sees half of one; processes
that ask while it works (a test suite's workers, a bench's engines) wait on a lock of the cache directory instead of
each making a copy of their own: on a fresh 2-core CI machine three test workers converting the GGUF at once took
100-130 s each, against 40 s for one conversion alone.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from kvstore.errors import StorageError

__all__ = ["built_once"]

logger = logging.getLogger(__name__)


def built_once(target: Path, marker: str, build: Callable[[Path], None], what: str) -> Path:
    """``target``, made by ``build`` (which fills the empty directory it is given) unless ``target / marker`` exists.

    Args:
        target: the directory to return; its parent is created when missing and locked while ``build`` runs.
        marker: a file ``build`` writes, whose presence in ``target`` means it is whole (the rename brings it with
            the rest): ``config.json``.
        build: writes the directory's contents; an ``OSError`` from it is a storage error, anything else propagates.
        what: the directory's description in messages ("the converted model").

    Raises:
        StorageError: the cache directory cannot be created or written (the message says to free space or pass
            another cache directory).
    """
    if (target / marker).is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = os.open(target.parent, os.O_RDONLY)
    except OSError as exc:
        raise StorageError(f"cannot create a directory in {target.parent} for {what} ({exc}); pass another "
                           "cache_dir") from exc  # fmt: skip
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the descriptor closes, or the process dies
        except OSError as exc:  # a filesystem without locks: each asker makes a copy, the first rename wins
            logger.debug("cannot lock %s (%s); making %s without waiting for other processes", target.parent, exc,
                         what)  # fmt: skip
        if (target / marker).is_file():
            logger.info("another process made %s first; using its copy", what)
            return target
        _make(target, marker, build, what)
    finally:
        os.close(lock)
    return target


def _make(target: Path, marker: str, build: Callable[[Path], None], what: str) -> None:
    try:
        partial = Path(tempfile.mkdtemp(prefix=f"{target.name}.partial-", dir=target.parent))
    except OSError as exc:
        raise StorageError(f"cannot create a directory in {target.parent} for {what} ({exc}); pass another "
                           "cache_dir") from exc  # fmt: skip
    try:
        build(partial)
        try:
            os.rename(partial, target)
        except OSError:
            if not (target / marker).is_file():  # a process of an older kvstore, which does not lock, came first
                raise
            logger.info("another process made %s first; using its copy", what)
    except OSError as exc:
        raise StorageError(f"cannot write {what} to {target} ({exc}); free space or pass another cache_dir") from exc
    finally:
        shutil.rmtree(partial, ignore_errors=True)
