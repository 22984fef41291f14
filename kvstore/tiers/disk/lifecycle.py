"""The open/closed state of a resource owned by one process, and the lock that orders work before close.

Every call on a tier starts with ``check()``: after ``close()`` it raises ``StoreClosedError``, and in a
process forked from the owner it raises ``StorageError`` (LMDB environments and threads do not survive
``fork``). ``while_open()`` holds the lock across a check and the hand-off of work (queueing a write), so
``close()`` cannot slip in between and the work is always drained by ``close``.

Threads: any. ``_lock`` guards ``_state``.
"""

from __future__ import annotations

import contextlib
import enum
import os
import threading
from collections.abc import Iterator

from kvstore.errors import StorageError, StoreClosedError

__all__ = ["Lifecycle", "OwnedLifecycle"]


class Lifecycle(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


class OwnedLifecycle:
    """Lifecycle of one resource, named in messages as ``what`` (e.g. ``"disk tier kvstore-data"``)."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._owner_pid = os.getpid()
        self._lock = threading.Lock()
        self._state = Lifecycle.OPEN

    @property
    def in_owner_process(self) -> bool:
        return os.getpid() == self._owner_pid

    def check(self) -> None:
        """Raise unless the resource is open and this is the process that opened it."""
        if self._state is Lifecycle.CLOSED:
            raise StoreClosedError(f"{self._what} was closed; open a new one")
        if not self.in_owner_process:
            raise StorageError(
                f"{self._what} was opened by process {self._owner_pid} and used in forked process "
                f"{os.getpid()}; LMDB environments and threads do not survive fork: open a new one in the "
                "child"
            )

    @contextlib.contextmanager
    def while_open(self) -> Iterator[None]:
        """Check, then keep ``close()`` out until the block ends."""
        with self._lock:
            self.check()
            yield

    def close(self) -> bool:
        """Mark closed; ``True`` for the one call that must release the resources (in the owner process)."""
        with self._lock:
            if self._state is Lifecycle.CLOSED:
                return False
            self._state = Lifecycle.CLOSED
        return self.in_owner_process
