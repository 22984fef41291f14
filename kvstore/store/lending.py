"""A lent retrieve: where a plan's chunks lie in the shared cpu arena, for a same-host client to copy them itself.

A plain retrieve copies every segment into the caller's buffer; the caller then copies it again, into its engine's
blocks. When every segment the caller needs is pinned in a cpu tier kept in shared memory (``ArenaTier.shared``),
the server can instead name each chunk's slot (its byte offset in the arena) and leave the plan's pins in place:
the caller, which maps the arena read-only, copies straight from the slots into its blocks and then hands the plan
back (its pins go then, as after a retrieve). A plan with any segment elsewhere (the gpu tier, the disk, a prefetch
still running, a shared tier) is not lent: the caller retrieves it as before, its pins untouched.

Pure function of the plan, its pins and the tiers; thread-safe as the tiers are.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.plan import Loan, LookupPlan
from kvstore.store.miss_attribution import retrieve_misses
from kvstore.store.pins import Pin
from kvstore.tiers.arena import ArenaTier

__all__ = ["lend_segments"]


def lend_segments(plan: LookupPlan, pins: Sequence[Pin], start: int) -> Loan | None:
    """The loan of ``plan`` from ``start``, or ``None`` when some segment it needs is not pinned in a shared arena
    with the length the plan says (the caller then retrieves). The plan's prefetches must be over."""
    lenders = {key: tier for tier, key in pins if isinstance(tier, ArenaTier) and tier.shared is not None}
    segments = [segment for segment in plan.segments if segment.end > start]
    offsets: list[int] = []
    for segment in segments:
        tier = lenders.get(segment.key)
        offset = tier.lent_offset(segment.key, segment.stored_tokens) if tier is not None else None
        if offset is None:
            return None
        offsets.append(offset)
    return Loan(
        segments=tuple(segments),
        offsets=tuple(offsets),
        num_query_tokens=plan.num_query_tokens,
        start=start,
        misses=retrieve_misses(plan.misses, (), start),
    )
