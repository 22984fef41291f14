"""``StoreSurface``: what an engine may ask of a store, whether the store is in its process or behind a server.

``TieredStore`` (in process) and ``Client`` (a running ``kvstore serve``) both satisfy it; mypy checks that they do
(``tests/test_surface.py`` assigns each to it). Code that only reads and writes KV -- the blender, the benchmarks --
takes a ``StoreSurface``, so it runs unchanged against either.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import torch

    from kvstore.keys import PrefixKey
    from kvstore.layout import KVLayout
    from kvstore.plan import LookupPlan, RetrieveProgress, RetrieveResult, StoreResult
    from kvstore.session import Session
    from kvstore.stats import StoreStats
    from kvstore.tiers.base import TierName

__all__ = ["StoreSurface"]


class StoreSurface(Protocol):
    """The store's operations, with ``TieredStore``'s contracts (see each method there)."""

    @property
    def layout(self) -> KVLayout | None:
        """The model layout every chunk has (``None`` only for an admin ``Client``, which stores nothing)."""
        ...

    def store(
        self, tokens: Sequence[int] | npt.NDArray[np.integer], kv: torch.Tensor, *, start: int = 0
    ) -> StoreResult: ...

    def lookup(
        self,
        tokens: Sequence[int] | npt.NDArray[np.integer],
        *,
        session_id: str | None = None,
        blend: bool | None = None,
        repeat: bool = False,
    ) -> LookupPlan: ...

    def retrieve(
        self,
        plan: LookupPlan,
        out: torch.Tensor | None = None,
        *,
        device: str | torch.device = "cpu",
        progress: RetrieveProgress | None = None,
        memory_only: bool = False,
        start: int = 0,
    ) -> RetrieveResult: ...

    def release(self, plan: LookupPlan) -> None: ...

    def session(self, session_id: str | None = None) -> Session: ...

    def end_session(self, session_id: str) -> None: ...

    def evict(self, keys: Sequence[PrefixKey]) -> int: ...

    def evict_bytes(self, num_bytes: int, tier: TierName | str) -> int: ...

    def flush(self) -> None: ...

    def stats(self) -> StoreStats: ...

    def close(self) -> None: ...
