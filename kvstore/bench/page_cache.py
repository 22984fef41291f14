"""Cold reads for benchmarks: drop a directory's files from the kernel's page cache."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["drop_page_cache"]


def drop_page_cache(directory: Path) -> None:
    """Drop every file under ``directory`` from the page cache, so the next read comes from the device.

    Only clean pages go: sync (close the tier) first. Unprivileged and per file, unlike ``/proc/sys/vm/drop_caches``.
    """
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
