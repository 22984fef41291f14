"""A full filesystem under the disk tier: one warning per outage, one line when writes resume.

When the filesystem fills, every disk write fails (LMDB reports a short page write as an I/O error), possibly
hundreds a second; a traceback each would bury the log. A failure is blamed on a full filesystem when, right
after it, the filesystem has less free space than the failed write needed (plus a margin for LMDB's own pages).
Then the first failure of an outage logs one warning with the figures an operator needs, later ones are only
counted, and the first commit that succeeds again logs how long the outage lasted and what it cost. Nothing else
is needed to heal: LMDB aborts the failed transaction cleanly, committed chunks stay, and a later commit simply
uses the space once it is there again; the outage ends at the first commit after the filesystem has room again
(tests/tiers/disk/test_full_filesystem.py, on a small tmpfs).

Any other write failure is not explained here and keeps its traceback (``explains`` returns ``False``).

Threads: the disk writer thread only.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["DiskOutage"]

logger = logging.getLogger(__name__)

_MARGIN_BYTES = 4 * 2**20  # LMDB writes branch, leaf and meta pages beside the frames


class DiskOutage:
    """Watches write failures of one data dir for a full filesystem.

    Args:
        path: the data dir.
        file_bytes: the current size of ``data.mdb`` (for the warning).
        capacity_bytes: the tier's cap (for the warning).
        clock: seconds, for the outage's length.
    """

    def __init__(
        self,
        path: Path,
        file_bytes: Callable[[], int],
        capacity_bytes: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._path = path
        self._file_bytes = file_bytes
        self._capacity_bytes = capacity_bytes
        self._clock = clock
        self._since: float | None = None
        self._failed_writes = 0

    def free_bytes(self) -> int:
        """Bytes an unprivileged writer may still use on the data dir's filesystem."""
        info = os.statvfs(self._path)
        return info.f_bavail * info.f_frsize

    def explains(self, num_writes: int, needed_bytes: int) -> bool:
        """Account a failed write of ``num_writes`` chunks (``needed_bytes`` stored bytes); ``True`` when the
        filesystem is full, so the caller logs nothing more (the first failure of an outage logs a warning)."""
        try:
            free = self.free_bytes()
        except OSError:
            return False
        if free >= needed_bytes + _MARGIN_BYTES:
            return False
        self._failed_writes += num_writes
        if self._since is None:
            self._since = self._clock()
            logger.warning(
                "disk tier %s: the filesystem is full (%.1f MiB free; data.mdb is %.1f MiB, the tier's cap %.1f MiB): "
                "new chunks stay in the memory tiers only, chunks already on disk are kept and served; writes "
                "resume by themselves once space is freed",
                self._path,
                free / 2**20,
                self._file_bytes() / 2**20,
                self._capacity_bytes / 2**20,
            )
        return True

    def committed(self) -> None:
        """A write transaction committed: end the outage, if one was going on and the filesystem has room again,
        with one line. (On a full filesystem a commit can still fit into pages LMDB freed earlier; that is not the
        end of the outage, and ending it there would log the same outage over and over.)"""
        if self._since is None:
            return
        try:
            if self.free_bytes() < _MARGIN_BYTES:
                return
        except OSError:
            return
        logger.warning(
            "disk tier %s: writes resumed after %.1f s of a full filesystem (%d chunk writes dropped meanwhile)",
            self._path,
            self._clock() - self._since,
            self._failed_writes,
        )
        self._since = None
        self._failed_writes = 0
