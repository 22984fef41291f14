"""Lookup hit counting: one plan's coverage counted in one pass, the per-tier tally, the bounded per-chunk counter."""

from __future__ import annotations

from kvstore.keys import PrefixKey
from kvstore.plan import LookupPlan, Segment
from kvstore.server.usage.chunk_hits import ChunkHitCounter
from kvstore.server.usage.plan_coverage import PlanCoverage
from kvstore.store.lookup_counts import LookupCounts
from kvstore.tiers.base import TierName, TierStats


def _segment(start: int, num_tokens: int, *, exact: bool, tier: TierName) -> Segment:
    return Segment(
        start=start, num_tokens=num_tokens, key=PrefixKey(bytes([start]) * 16), source_start=start, exact=exact,
        tier=tier,
    )  # fmt: skip


def test_plan_coverage_counts_exact_blend_gap_tiers_and_misses() -> None:
    """Issue 5: the lookup metrics and the tally read one ``PlanCoverage`` instead of each walking the segments."""
    segments = (
        _segment(0, 16, exact=True, tier=TierName.CPU),
        _segment(16, 16, exact=True, tier=TierName.DISK),
        _segment(48, 16, exact=False, tier=TierName.CPU),
        _segment(64, 5, exact=False, tier=TierName.GPU),
    )
    plan = LookupPlan(plan_id=1, session_id=None, num_query_tokens=80, segments=segments)
    coverage = PlanCoverage.of(plan, chunk_size=16)
    assert (coverage.num_exact_tokens, coverage.num_blend_tokens, coverage.num_gap_tokens) == (32, 21, 27)
    assert coverage.num_chunks_by_tier == {TierName.CPU: 2, TierName.DISK: 1, TierName.GPU: 1}
    assert coverage.num_missed_chunks == 1  # 80 tokens are 5 chunks of 16; 4 were planned
    empty = PlanCoverage.of(LookupPlan(plan_id=2, session_id=None, num_query_tokens=0, segments=()), chunk_size=16)
    assert (empty.num_gap_tokens, empty.num_missed_chunks, empty.num_chunks_by_tier) == (0, 0, {})

    counts = LookupCounts(chunk_size=16)
    counts.add(plan.num_query_tokens, list(plan.segments))
    counts.add(plan.num_query_tokens, list(plan.segments))
    cpu = counts.apply(TierStats(tier=TierName.CPU, capacity_bytes=1, used_bytes=0, stored_bytes=0, num_chunks=0,
                                 num_pinned=0, puts=0, rejected_puts=0, evictions=0))  # fmt: skip
    assert (cpu.hits, cpu.misses, cpu.hit_ratio) == (4, 6, 0.4)  # 10 chunks looked up, 4 planned from cpu


def test_hit_counter_keeps_the_most_hit_half_when_full() -> None:
    counter = ChunkHitCounter(max_keys=4)
    keys = [PrefixKey(bytes([index]) * 16) for index in range(5)]
    counter.add([keys[0], keys[0], keys[0], keys[1], keys[1], keys[2], keys[3]])
    counter.add([keys[4]])
    assert counter.top(5) == [(keys[0], 3), (keys[1], 2)] and counter.hits(keys[4]) == 0
