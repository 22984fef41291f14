"""A blend pass on a tensor-parallel vLLM engine: the ranks agree through the group's CPU process group, and share
one plan the lead rank looked up.

Every rank of the group runs the pass on its own KV heads (``kvstore.blend.ranks`` says what must agree and why).
The agreements are small collectives on vLLM's CPU group for the tensor-parallel ranks (gloo), run on the
model-runner thread between the pass's layers: two or three integers per layer that waits for loaded KV, one
``[num_candidates]`` float tensor at the check layer, and the plan once per pass. The summed scores are broadcast
from the lead after the sum, so every rank ranks the same bits whatever order the reduction added them in.

The plan is looked up once, by the lead, pinned for every rank (``readers``), and each rank retrieves its own heads
of it (``KVPart``); the server drops the pins once every rank has retrieved or released it. The lookup takes no
session: the pass retrieves or releases the plan on every path, and a dead client's pins go with it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch

from kvstore.errors import KVStoreError

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from kvstore.client import Client
    from kvstore.kv_part import KVPart
    from kvstore.plan import LookupPlan, RetrieveProgress, RetrieveResult

__all__ = ["LeadRankPlans", "TensorParallelRanks"]

_Shared = TypeVar("_Shared")


class TensorParallelRanks:
    """``RankAgreement`` over a vLLM ``GroupCoordinator`` (the tensor-parallel group), on its CPU group."""

    def __init__(self, group: Any) -> None:
        self._group = group.cpu_group
        self._lead = int(group.ranks[0])  # the group's first rank, as a global rank (torch.distributed's src)
        self.is_lead = int(group.rank_in_group) == 0
        self.size = int(group.world_size)

    def lead_value(self, make: Callable[[], _Shared]) -> _Shared:
        error: Exception | None = None
        message: list[tuple[bool, Any] | None] = [None]  # (made, the value or what went wrong)
        if self.is_lead:
            try:
                message[0] = (True, make())
            except Exception as exc:  # told to every rank, then raised here as it was
                error = exc
                message[0] = (False, f"{type(exc).__name__}: {exc}")
        torch.distributed.broadcast_object_list(message, src=self._lead, group=self._group)
        if error is not None:
            raise error
        received = message[0]
        assert received is not None, "the lead broadcast nothing"
        made, value = received
        if not made:
            raise KVStoreError(f"the lead rank's part of the blend pass failed: {value}")
        return cast(_Shared, value)

    def all_true(self, flag: bool) -> bool:
        votes = torch.tensor([int(flag)], dtype=torch.int64)
        torch.distributed.all_reduce(votes, op=torch.distributed.ReduceOp.MIN, group=self._group)
        return bool(votes.item())

    def all_equal(self, digest: int) -> bool:
        bounds = torch.tensor([digest, -digest], dtype=torch.int64)  # min of both: the least and the greatest digest
        torch.distributed.all_reduce(bounds, op=torch.distributed.ReduceOp.MIN, group=self._group)
        return int(bounds[0]) == -int(bounds[1])

    def summed(self, scores: torch.Tensor) -> torch.Tensor:
        total = scores.to("cpu", torch.float32, copy=True)
        torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM, group=self._group)
        torch.distributed.broadcast(total, src=self._lead, group=self._group)
        return total.to(scores.device)


class LeadRankPlans:
    """A ``PlanSource`` for one pass on one rank: the lead's plan, retrieved for this rank's heads.

    Args:
        client: this rank's client of the store.
        ranks: the group.
        part: this rank's layers and KV heads (``None``: the whole chunk, e.g. heads replicated on every rank).
    """

    def __init__(self, client: Client, ranks: TensorParallelRanks, part: KVPart | None) -> None:
        self._client = client
        self._ranks = ranks
        self._part = part
        self._owner: str | None = None  # the lead's client token: another rank's retrieve names the plan's owner

    def lookup(
        self, tokens: Sequence[int] | npt.NDArray[np.integer], *, blend: bool | None = None, repeat: bool = False
    ) -> LookupPlan:
        """The lead's pinned plan of ``tokens``, on every rank.

        Raises:
            KVStoreError: the lead's lookup failed (every rank raises).
        """

        def look_up() -> tuple[LookupPlan, str]:
            plan = self._client.lookup(tokens, blend=blend, repeat=repeat)
            return dataclasses.replace(plan, prefetches=()), self._client.client_token  # futures stay here

        plan, owner = self._ranks.lead_value(look_up)
        self._owner = None if self._ranks.is_lead else owner
        return plan

    def retrieve(
        self,
        plan: LookupPlan,
        out: torch.Tensor | None = None,
        *,
        progress: RetrieveProgress | None = None,
        memory_only: bool = False,
    ) -> RetrieveResult:
        return self._client.retrieve(
            plan,
            out,
            progress=progress,
            memory_only=memory_only,
            owner=self._owner,
            part=self._part,
            readers=self._ranks.size,
        )

    def release(self, plan: LookupPlan) -> None:
        self._client.release(plan, owner=self._owner, readers=self._ranks.size)
