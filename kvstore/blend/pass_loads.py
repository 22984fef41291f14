"""Where a blend pass's cached KV comes from: the plan's owner, and the retrieve the pass starts on the loader.

The pass looks the prompt up, retrieves or releases the plan, through a ``PlanSource``: a ``Session`` of the store
(one worker), or, on a tensor-parallel engine, one plan looked up by the lead rank and retrieved by every rank for
its own KV heads. Chunks only the disk holds are read or left to compute as the settings and the learnt load and
compute rates say (``load_cost``); on several ranks all of them decide it together (``ranks``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch

from kvstore.blend.config import BlendConfig, DiskPolicy
from kvstore.blend.kv_loading import KVLoader, PendingLoad
from kvstore.blend.load_cost import LoadCostModel, disk_bound_segments, skipped_token_layers
from kvstore.blend.ranks import RankAgreement
from kvstore.layout import KVLayout
from kvstore.plan import LookupPlan, RetrieveProgress, RetrieveResult, Segment

__all__ = ["NO_LOAD", "PassLoad", "PlanSource", "start_load"]


class PlanSource(Protocol):
    """Looks a prompt up and retrieves or releases the plan (what a pass needs of a ``Session``)."""

    def lookup(
        self, tokens: Sequence[int] | npt.NDArray[np.integer], *, blend: bool | None = None, repeat: bool = False
    ) -> LookupPlan: ...

    def retrieve(
        self,
        plan: LookupPlan,
        out: torch.Tensor | None = None,
        *,
        progress: RetrieveProgress | None = None,
        memory_only: bool = False,
    ) -> RetrieveResult: ...

    def release(self, plan: LookupPlan) -> None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class PassLoad:
    """The retrieve a pass started (``None``: nothing cached is read, the plan was released), and the segments only
    the disk held: read (``memory_only`` false) or left to compute."""

    pending: PendingLoad | None
    disk_bound: tuple[Segment, ...] = ()
    memory_only: bool = False

    def settle(self) -> None:
        """Wait for the retrieve to finish (or fail) on every path out of the pass."""
        if self.pending is not None:
            self.pending.settle()

    @property
    def total_ms(self) -> float:
        """The retrieve's whole duration; 0 without one."""
        return self.pending.duration_ms() if self.pending is not None else 0.0

    def disk_wait_bytes(self, layout: KVLayout) -> int:
        """Bytes the retrieve read from disk while the pass could wait for them (a slice's whole chunk is read)."""
        if self.memory_only:
            return 0
        return sum(layout.chunk_bytes(segment.stored_tokens) for segment in self.disk_bound)

    @property
    def num_skipped_disk_tokens(self) -> int:
        """Tokens of the disk-only segments left to compute."""
        return sum(segment.num_tokens for segment in self.disk_bound) if self.memory_only else 0


NO_LOAD = PassLoad(pending=None)


def start_load(
    owner: PlanSource,
    loader: KVLoader,
    plan: LookupPlan,
    buffer: torch.Tensor,
    settings: BlendConfig,
    costs: LoadCostModel,
    *,
    num_layers: int,
    ranks: RankAgreement,
) -> PassLoad:
    """Start the retrieve of ``plan`` into ``buffer`` on the loader, reading the disk-only segments or leaving them
    to compute as the settings and ``costs`` say (on several ranks: only when every rank would)."""
    disk_bound = disk_bound_segments(plan)
    memory_only = ranks.all_true(_skips_disk(settings, costs, disk_bound, num_layers))
    pending = loader.start(
        lambda out, progress: owner.retrieve(plan, out, progress=progress, memory_only=memory_only), buffer
    )
    return PassLoad(pending=pending, disk_bound=disk_bound, memory_only=memory_only)


def _skips_disk(settings: BlendConfig, costs: LoadCostModel, disk_bound: Sequence[Segment], num_layers: int) -> bool:
    """Whether this pass leaves the chunks only the disk holds to compute (``load_cost``)."""
    if not disk_bound or settings.disk_policy is DiskPolicy.WAIT:
        return False
    if settings.disk_policy is DiskPolicy.RECOMPUTE:
        return True
    extra = skipped_token_layers(
        disk_bound, num_layers=num_layers, check_layer=settings.check_layer, recompute_ratio=settings.recompute_ratio
    )
    return costs.recompute_is_faster(disk_bound, extra)
