"""Miss reasons: every token a lookup or retrieve does not serve is under exactly one reason, and the reason is the
true one (never stored, evicted from the tier that dropped it last, behind a gap, two strikes, a failed checksum,
disk slower than recompute). Real stores: tiers in host memory and LMDB on disk."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import KVLayout, TieredStore
from kvstore.keys import prefix_keys
from kvstore.misses import Miss, MissReason, tokens_by_reason
from kvstore.plan import LookupPlan, RetrieveResult
from kvstore.tiers.base import TierName
from tests.factories import flip_frame_bit, make_kv, make_tokens, store_config

CHUNK = 8


def reasons(plan_or_result: LookupPlan | RetrieveResult) -> list[tuple[int, int, str]]:
    return [(miss.start, miss.end, miss.reason.value) for miss in plan_or_result.misses]


def assert_tiles(segments_and_misses: LookupPlan | RetrieveResult, start: int = 0) -> None:
    """Segments and misses cover ``[start, num_query_tokens)`` exactly once, in order."""
    pieces = sorted(
        [(max(s.start, start), s.end) for s in segments_and_misses.segments if s.end > start]
        + [(m.start, m.end) for m in segments_and_misses.misses]
    )
    cursor = start
    for piece_start, piece_end in pieces:
        assert piece_start == cursor and piece_end > piece_start, pieces
        cursor = piece_end
    assert cursor == segments_and_misses.num_query_tokens, pieces


@pytest.fixture
def cpu_store(tmp_path: Path, small_layout: KVLayout) -> Iterator[TieredStore]:
    config = store_config(tmp_path, small_layout, CHUNK, gpu_chunks=0, cpu_chunks=6, tiers=(TierName.CPU,))
    with TieredStore(small_layout, config) as opened:
        yield opened


def test_a_prompt_never_stored_is_one_never_stored_miss(cpu_store: TieredStore) -> None:
    plan = cpu_store.lookup(make_tokens(29))
    assert reasons(plan) == [(0, 29, "never_stored")]
    cpu_store.release(plan)


def test_an_evicted_chunk_is_evicted_from_its_tier_and_the_rest_behind_it_is_behind_the_gap(
    cpu_store: TieredStore, small_layout: KVLayout
) -> None:
    tokens = make_tokens(4 * CHUNK + 3)
    cpu_store.store(tokens, make_kv(small_layout, len(tokens)))
    cpu_store.evict([prefix_keys(small_layout.namespace, tokens, CHUNK)[1]])
    plan = cpu_store.lookup(np.concatenate([tokens, [5, 5]]))
    assert reasons(plan) == [
        (CHUNK, 2 * CHUNK, "evicted_cpu"),
        (2 * CHUNK, 4 * CHUNK, "behind_gap"),  # resident, but the lookup stops at its first miss
        (4 * CHUNK, len(tokens) + 2, "never_stored"),  # a last chunk of other tokens than the stored one's
    ]
    assert_tiles(plan)
    cpu_store.release(plan)


def test_a_chunk_reads_as_evicted_from_the_tier_that_dropped_it_last(
    tmp_path: Path, small_layout: KVLayout
) -> None:
    config = store_config(tmp_path, small_layout, CHUNK, gpu_chunks=2, cpu_chunks=2, disk_capacity_bytes=64 << 20)
    with TieredStore(small_layout, config) as store:
        first = make_tokens(2 * CHUNK, seed=1)
        store.store(first, make_kv(small_layout, 2 * CHUNK, seed=1))
        for seed in range(2, 6):  # push `first` out of the gpu and cpu tiers; the disk keeps it
            store.store(make_tokens(2 * CHUNK, seed=seed), make_kv(small_layout, 2 * CHUNK, seed=seed))
        store.flush()
        for tier in ("gpu", "cpu"):  # the memory tiers drop it: the disk still serves it
            store.evict_bytes(64 << 20, tier)
        plan = store.lookup(first)
        assert reasons(plan) == [] and plan.num_prefix_tokens == 2 * CHUNK
        assert plan.wait(timeout=30)  # the hit's prefetch lands in the cpu tier (else it may land after the evictions)
        store.release(plan)
        for tier in ("gpu", "cpu", "disk"):  # and then every tier drops it, the disk last
            store.evict_bytes(64 << 20, tier)
        plan = store.lookup(first)
        assert reasons(plan) == [(0, 2 * CHUNK, "evicted_disk")]
        store.release(plan)


def test_segmented_prefix_serves_behind_a_gap_and_the_gap_keeps_its_reason(
    tmp_path: Path, small_layout: KVLayout
) -> None:
    config = store_config(
        tmp_path, small_layout, CHUNK, gpu_chunks=0, cpu_chunks=8, tiers=(TierName.CPU,), enable_segmented_prefix=True
    )
    with TieredStore(small_layout, config) as store:
        tokens = make_tokens(4 * CHUNK)
        store.store(tokens, make_kv(small_layout, len(tokens)))
        store.evict([prefix_keys(small_layout.namespace, tokens, CHUNK)[2]])
        plan = store.lookup(tokens)
        assert reasons(plan) == [(2 * CHUNK, 3 * CHUNK, "evicted_cpu")]
        assert [segment.start for segment in plan.segments] == [0, CHUNK, 3 * CHUNK]
        store.release(plan)


def test_a_content_match_whose_chunk_is_gone_is_evicted_then_two_strike(
    tmp_path: Path, small_layout: KVLayout
) -> None:
    config = store_config(
        tmp_path, small_layout, CHUNK, gpu_chunks=0, cpu_chunks=16, tiers=(TierName.CPU,), enable_blend=True
    )
    with TieredStore(small_layout, config) as store:
        doc = make_tokens(2 * CHUNK, seed=7)
        store.store(doc, make_kv(small_layout, 2 * CHUNK, seed=7))
        store.flush()
        store.evict(prefix_keys(small_layout.namespace, doc, CHUNK))
        prompt = np.concatenate([make_tokens(5, seed=8), doc])  # the document at another position
        reasons_by_lookup = []
        for _ in range(3):
            plan = store.lookup(prompt)
            assert_tiles(plan)
            reasons_by_lookup.append(tokens_by_reason(plan.misses, 5))
            store.release(plan)
        assert reasons_by_lookup[0] == {MissReason.EVICTED_CPU: 2 * CHUNK}, "first strike: the tier that dropped it"
        assert reasons_by_lookup[1] == {MissReason.TWO_STRIKE: 2 * CHUNK}, "second strike removes the entry"
        # the entry is gone: the index no longer knows the content (and its keys here were never stored)
        assert reasons_by_lookup[2] == {MissReason.NEVER_STORED: 2 * CHUNK}


def test_a_chunk_that_fails_its_checksum_on_retrieve_is_a_checksum_miss(
    tmp_path: Path, small_layout: KVLayout
) -> None:
    config = store_config(tmp_path, small_layout, CHUNK, gpu_chunks=0, cpu_chunks=0, tiers=(TierName.DISK,))
    with TieredStore(small_layout, config) as store:
        tokens = make_tokens(3 * CHUNK)
        store.store(tokens, make_kv(small_layout, len(tokens)))
        store.flush()
        keys = prefix_keys(small_layout.namespace, tokens, CHUNK)
        store.close()
        flip_frame_bit(config.data_dir, keys[1])
    with TieredStore(small_layout, config) as store:
        result = store.retrieve(store.lookup(tokens))
        assert reasons(result) == [(CHUNK, 2 * CHUNK, "checksum"), (2 * CHUNK, 3 * CHUNK, "behind_gap")]
        assert store.stats().lookups.missed_tokens == {"checksum": CHUNK, "behind_gap": CHUNK}


def test_memory_only_leaves_disk_chunks_as_disk_slower(tmp_path: Path, small_layout: KVLayout) -> None:
    config = store_config(
        tmp_path, small_layout, CHUNK, gpu_chunks=0, cpu_chunks=0, tiers=(TierName.DISK,), enable_segmented_prefix=True
    )
    with TieredStore(small_layout, config) as store:
        tokens = make_tokens(2 * CHUNK + 3)
        store.store(tokens, make_kv(small_layout, len(tokens)))
        store.flush()
        result = store.retrieve(store.lookup(tokens), memory_only=True, start=4)
        assert reasons(result) == [(4, len(tokens), "disk_slower")]
        assert_tiles(result, start=4)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    stored=st.lists(st.integers(0, 5), min_size=1, max_size=6),
    evicted=st.lists(st.integers(0, 7), max_size=4),
    prompt_seeds=st.lists(st.integers(0, 5), min_size=1, max_size=3),
    tail=st.integers(0, CHUNK + 1),
    segmented=st.booleans(),
)
def test_segments_and_misses_tile_every_prompt_and_the_totals_add_up(
    tmp_path_factory: pytest.TempPathFactory,
    small_layout: KVLayout,
    stored: list[int],
    evicted: list[int],
    prompt_seeds: list[int],
    tail: int,
    segmented: bool,
) -> None:
    """Documents stored, some chunks evicted, prompts of stored and unstored documents: every lookup and retrieve
    accounts for every token once, and the store's totals are the sums of what the plans said."""
    config = store_config(
        tmp_path_factory.mktemp("tiles"), small_layout, CHUNK, gpu_chunks=1, cpu_chunks=3, enable_blend=True,
        enable_segmented_prefix=segmented,
    )  # fmt: skip
    with TieredStore(small_layout, config) as store:
        for seed in stored:
            store.store(make_tokens(2 * CHUNK, seed=seed), make_kv(small_layout, 2 * CHUNK, seed=seed))
        store.flush()
        documents = [make_tokens(2 * CHUNK, seed=seed) for seed in range(6)]
        all_keys = [key for doc in documents for key in prefix_keys(small_layout.namespace, doc, CHUNK)]
        store.evict([all_keys[index] for index in evicted])
        prompt = np.concatenate([make_tokens(2 * CHUNK, seed=seed) for seed in prompt_seeds] + [make_tokens(tail, 99)])
        missed: dict[str, int] = {}
        plan = store.lookup(prompt)
        assert_tiles(plan)
        result = store.retrieve(plan)
        assert_tiles(result)
        for reason, count in tokens_by_reason(result.misses).items():
            missed[reason.value] = missed.get(reason.value, 0) + count
        served = sum(segment.num_tokens for segment in result.segments)
        assert served + sum(missed.values()) == len(prompt)
        totals = store.stats().lookups
        assert totals.looked_up_tokens == len(prompt)
        assert totals.missed_tokens == missed


def test_the_miss_dataclass_counts_only_inside_the_window() -> None:
    misses = [Miss(0, 10, MissReason.NEVER_STORED), Miss(10, 20, MissReason.EVICTED_CPU)]
    assert tokens_by_reason(misses, 5, 15) == {MissReason.NEVER_STORED: 5, MissReason.EVICTED_CPU: 5}
    assert tokens_by_reason(misses, 20) == {}


def test_chunks_pushed_out_by_capacity_read_as_evicted_from_the_cpu_tier(
    cpu_store: TieredStore, small_layout: KVLayout
) -> None:
    first = make_tokens(2 * CHUNK, seed=1)
    cpu_store.store(first, make_kv(small_layout, 2 * CHUNK, seed=1))
    for seed in range(2, 5):  # 6 more chunks into a 6-chunk tier: `first` is least recently used
        cpu_store.store(make_tokens(2 * CHUNK, seed=seed), make_kv(small_layout, 2 * CHUNK, seed=seed))
    plan = cpu_store.lookup(first)
    assert reasons(plan) == [(0, 2 * CHUNK, "evicted_cpu")]
    cpu_store.release(plan)
