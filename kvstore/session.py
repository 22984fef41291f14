"""``Session``: one request's handle on a store, whose end drops the pins of every plan it looked up.

A value both ends use: ``TieredStore.session()`` and ``Client.session()`` return one, and the blender and the
connectors take one, so it lives below the store (the pins themselves are the store's: ``kvstore.store.pins``).

Threads: a session is one request's; its owner (the store or a client) is thread-safe.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt
import torch

if TYPE_CHECKING:
    from kvstore.plan import LookupPlan, RetrieveProgress, RetrieveResult

__all__ = ["Session", "SessionOwner"]


class SessionOwner(Protocol):
    """What a ``Session`` needs from the store (kept narrow so this module never imports the store)."""

    def lookup(
        self,
        tokens: Sequence[int] | npt.NDArray[np.integer],
        *,
        session_id: str | None = ...,
        blend: bool | None = ...,
        repeat: bool = ...,
    ) -> LookupPlan: ...

    def retrieve(
        self,
        plan: LookupPlan,
        out: torch.Tensor | None = ...,
        *,
        device: str | torch.device = ...,
        progress: RetrieveProgress | None = ...,
        memory_only: bool = ...,
        start: int = ...,
    ) -> RetrieveResult: ...

    def release(self, plan: LookupPlan) -> None: ...

    def end_session(self, session_id: str) -> None: ...


_session_ids = itertools.count(1)


class Session:
    """One request's view of the store: its plans' pins are dropped when the session ends.

    End it with ``close()`` or a ``with`` block; a session the caller drops without closing is ended when it is
    garbage-collected, so an abandoned request never leaves chunks pinned.

    Example::

        with store.session() as session:
            plan = session.lookup(prompt_tokens)
            result = session.retrieve(plan)   # or never retrieve: the pins still go at the end of the block
    """

    def __init__(self, owner: SessionOwner, session_id: str | None = None) -> None:
        self.session_id = session_id or f"session-{next(_session_ids)}"
        self._owner = owner
        self._finalizer = weakref.finalize(self, _end_session, weakref.ref(owner), self.session_id)

    def lookup(
        self, tokens: Sequence[int] | npt.NDArray[np.integer], *, blend: bool | None = None, repeat: bool = False
    ) -> LookupPlan:
        """``TieredStore.lookup`` within this session."""
        return self._owner.lookup(tokens, session_id=self.session_id, blend=blend, repeat=repeat)

    def retrieve(
        self,
        plan: LookupPlan,
        out: torch.Tensor | None = None,
        *,
        device: str | torch.device = "cpu",
        progress: RetrieveProgress | None = None,
        memory_only: bool = False,
        start: int = 0,
    ) -> RetrieveResult:
        """``TieredStore.retrieve``."""
        return self._owner.retrieve(plan, out, device=device, progress=progress, memory_only=memory_only, start=start)

    def release(self, plan: LookupPlan) -> None:
        """``TieredStore.release``."""
        self._owner.release(plan)

    def close(self) -> None:
        """End the session: release every plan it still holds. Idempotent."""
        self._finalizer()

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def _end_session(owner_ref: weakref.ref[SessionOwner], session_id: str) -> None:
    owner = owner_ref()
    if owner is not None:
        owner.end_session(session_id)
