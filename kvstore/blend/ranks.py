"""What a blend pass needs when several ranks run it together, each on its own KV heads (tensor parallelism).

A tensor-parallel engine runs one pass per rank, in lockstep: every rank computes the same tokens in every layer,
because the model's row-parallel layers (``o_proj``, the MLP's down projection, the embedding) sum their outputs
over the group. Any difference between the ranks' token sets is a wrong answer or a hang in that sum. So the pass
asks its ``RankAgreement`` at each point where one rank could otherwise go its own way:

- the plan: one rank looks the prompt up and hands the plan to the others (the pass's ``PlanSource``);
- whether to leave the disk's chunks to compute: all ranks skip them, or none does;
- whether the pass can go on: a buffer, a retrieve or a layer's load that failed on one rank fails it on all, at
  the same point, before the next sum (vLLM then recomputes the span on every rank);
- the chunks loaded: the same on every rank, or the pass fails;
- the selection: each rank scores the tokens on its own heads, and the scores are summed over the group before the
  top-k. The deviation and the attention mass are sums over heads, so the summed scores are what one rank holding
  every head would compute: the selection is the one-rank selection (up to float rounding), not each rank's own.

``ONE_RANK`` agrees with itself at no cost; a single-worker pass never sees another.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

import torch

__all__ = ["ONE_RANK", "RankAgreement"]

_Shared = TypeVar("_Shared")


class RankAgreement(Protocol):
    """The ranks of one tensor-parallel group agreeing on a pass (see the module docstring). Every rank calls the
    same methods in the same order."""

    def lead_value(self, make: Callable[[], _Shared]) -> _Shared:
        """``make()`` run on the lead rank, its result on every rank.

        Raises:
            KVStoreError: ``make`` raised on the lead (every rank raises; the lead its own error).
        """
        ...

    def all_true(self, flag: bool) -> bool:
        """Whether ``flag`` is true on every rank."""
        ...

    def all_equal(self, digest: int) -> bool:
        """Whether every rank passed the same ``digest`` (a 62-bit hash of what must agree)."""
        ...

    def summed(self, scores: torch.Tensor) -> torch.Tensor:
        """``scores`` summed over the ranks, the same bits on every rank."""
        ...


class _OneRank:
    """A pass on one worker: nothing to agree with."""

    def lead_value(self, make: Callable[[], _Shared]) -> _Shared:
        return make()

    def all_true(self, flag: bool) -> bool:
        return flag

    def all_equal(self, digest: int) -> bool:
        return True

    def summed(self, scores: torch.Tensor) -> torch.Tensor:
        return scores


ONE_RANK: RankAgreement = _OneRank()
