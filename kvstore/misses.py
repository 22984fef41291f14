"""Why a looked-up token was not served: one reason per missed token, so the reasons add up to the misses.

This module is the reasons' one home (the store, the wire, the tiers and the connectors import them from here); the
store decides which reason a lookup's gap gets in ``kvstore.store.miss_attribution``.

A lookup tiles its prompt into segments (served) and misses; a retrieve may turn a planned segment into a miss
(``CHECKSUM``, ``REMOTE_UNAVAILABLE``, ``EVICTED_REMOTE``); an engine connector adds the reasons only it knows
(a blend it declined, a hit it could not take). The store's reasons:

- ``never_stored``: no tier holds the chunk and none dropped it within the ghost table's reach (the last
  ``GHOST_CAPACITY`` removals since the store opened), and the content index has no entry for it.
- ``evicted_gpu`` / ``evicted_cpu`` / ``evicted_disk``: the chunk was resident and the named tier dropped it last
  (capacity eviction, an admin ``evict``, a corrupt copy dropped). ``evicted_remote``: the remote (Valkey) no longer
  had it when it was read. ``evicted``: a content index entry shows it was stored, and it has left every tier, but
  which tier dropped it last is beyond the ghost table's reach.
- ``behind_gap``: resident, but after a miss in a lookup without segmented prefix (it stops at the first miss).
- ``two_strike``: a content match pointed at a chunk gone from every tier, and this lookup gave its index entry the
  second strike that removed it.
- ``checksum``: the chunk was read and failed its checks (or held another length than planned); it was dropped.
- ``remote_unavailable``: the remote did not answer (an outage or a timeout).
- ``incomplete``: some ranks of a tensor- or pipeline-parallel engine stored their part of the chunk, and not all of
  them yet (``kvstore.server.chunk_assembly``): a chunk is stored only whole, so no rank loads half of it.

The connector's reasons (``kvstore.connectors``): ``blend_gate`` (the gate judged a full prefill of the span
faster than a blend pass), ``disk_slower`` (a blend pass skipped disk chunks it recomputes faster than it reads),
``behind_gap`` (cached, but after a miss: vLLM takes only a contiguous prefix), ``block_boundary`` (cached, but
past the last whole vLLM block, or the prompt's last token, which vLLM always computes), ``load_failed`` (the store
was unreachable or the load raised).
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from kvstore.tiers.base import TierName

__all__ = ["STORE_REASONS", "Miss", "MissReason", "evicted_from", "tokens_by_reason"]


class MissReason(enum.StrEnum):
    """Why tokens were not served (see the module docstring)."""

    NEVER_STORED = "never_stored"
    EVICTED_GPU = "evicted_gpu"
    EVICTED_CPU = "evicted_cpu"
    EVICTED_DISK = "evicted_disk"
    EVICTED_REMOTE = "evicted_remote"
    EVICTED = "evicted"
    TWO_STRIKE = "two_strike"
    CHECKSUM = "checksum"
    REMOTE_UNAVAILABLE = "remote_unavailable"
    BLEND_GATE = "blend_gate"
    DISK_SLOWER = "disk_slower"
    BEHIND_GAP = "behind_gap"
    BLOCK_BOUNDARY = "block_boundary"
    LOAD_FAILED = "load_failed"
    INCOMPLETE = "incomplete"  # appended: the wire codes index this order


STORE_REASONS = (
    MissReason.NEVER_STORED,
    MissReason.EVICTED_GPU,
    MissReason.EVICTED_CPU,
    MissReason.EVICTED_DISK,
    MissReason.EVICTED_REMOTE,
    MissReason.EVICTED,
    MissReason.TWO_STRIKE,
    MissReason.CHECKSUM,
    MissReason.REMOTE_UNAVAILABLE,
    MissReason.DISK_SLOWER,
    MissReason.BEHIND_GAP,
    MissReason.INCOMPLETE,
)
"""The reasons a store's lookups and retrieves give (the others are a connector's)."""

_EVICTED = {
    TierName.GPU: MissReason.EVICTED_GPU,
    TierName.CPU: MissReason.EVICTED_CPU,
    TierName.DISK: MissReason.EVICTED_DISK,
    TierName.REMOTE: MissReason.EVICTED_REMOTE,
}


def evicted_from(tier: TierName) -> MissReason:
    """The reason of a chunk ``tier`` dropped last."""
    return _EVICTED[tier]


@dataclass(frozen=True, slots=True)
class Miss:
    """Tokens ``[start, end)`` of a prompt, not served, and why."""

    start: int
    end: int
    reason: MissReason

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def tokens_by_reason(misses: Iterable[Miss], start: int = 0, end: int | None = None) -> Counter[MissReason]:
    """Missed tokens per reason, counting only the part of each miss inside ``[start, end)``."""
    counts: Counter[MissReason] = Counter()
    for miss in misses:
        overlap = min(miss.end, miss.end if end is None else end) - max(miss.start, start)
        if overlap > 0:
            counts[miss.reason] += overlap
    return counts
