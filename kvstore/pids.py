"""Whether a process is alive: what a dead client's segments, a stale ``serve.json`` and a waiting CLI ask."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["pid_alive"]


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
        status = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no procfs (or it just exited): trust the signal check
    return status[status.rfind(")") + 2 :][:1] != "Z"
