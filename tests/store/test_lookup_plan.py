"""The unified lookup on real tiers: plans, sessions, prefetch, registration, two-strike rules, segmented prefix,
dedup-content. Chunks of 8 tokens keep the data tiny; every tier is the real one (gpu logic on host memory)."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore import ConfigError, KVLayout, TieredStore
from kvstore.config import StoreConfig
from kvstore.content.catalog import ContentCatalog, ResidencyCheck
from kvstore.content.index import FingerprintIndex, RegistrationResult
from kvstore.content.registration import RegistrationJob, RegistrationWorker
from kvstore.keys import PrefixKey, as_token_array, prefix_keys
from kvstore.tiers.base import ChunkRecord, TierName
from kvstore.tiers.cpu import CpuTier
from tests.factories import flip_frame_bit, make_kv, make_tokens, run_in_threads, store_config

CHUNK = 8


def config(tmp_path: Path, layout: KVLayout, **changes: object) -> StoreConfig:
    return store_config(tmp_path, layout, CHUNK, gpu_chunks=8, cpu_chunks=16, **{"enable_blend": True, **changes})


@pytest.fixture
def store(tmp_path: Path, small_layout: KVLayout) -> Iterator[TieredStore]:
    with TieredStore(small_layout, config(tmp_path, small_layout)) as opened:
        yield opened


def memory_pins(store: TieredStore) -> int:
    return sum(tier.num_pinned for tier in store.stats().tiers)


def spans(plan_or_result) -> list[tuple[int, int, int, bool]]:  # type: ignore[no-untyped-def]
    return [(s.start, s.end, s.source_start, s.exact) for s in plan_or_result.segments]


# -- plans ------------------------------------------------------------------------------------------------------


def test_documents_in_another_order_become_blend_segments_at_their_places(
    store: TieredStore, small_layout: KVLayout
) -> None:
    doc_a, doc_b = make_tokens(20, seed=1), make_tokens(12, seed=2)
    kv_a, kv_b = make_kv(small_layout, 20, seed=1), make_kv(small_layout, 12, seed=2)
    store.store(doc_a, kv_a)
    store.store(doc_b, kv_b)
    system, question = make_tokens(5, seed=3), make_tokens(4, seed=4)
    prompt = np.concatenate([system, doc_b, [7, 7], doc_a, question])
    plan = store.lookup(prompt)
    b_at, a_at = 5, 5 + 12 + 2
    assert spans(plan) == [
        (b_at, b_at + 8, 0, False),
        (b_at + 8, b_at + 12, 8, False),  # doc B's partial last chunk, found through its sequence's next link
        (a_at, a_at + 8, 0, False),
        (a_at + 8, a_at + 16, 8, False),
        (a_at + 16, a_at + 20, 16, False),
    ]
    assert [(gap.start, gap.end) for gap in plan.gaps] == [(0, 5), (17, 19), (39, 43)]
    assert plan.num_cached_tokens == 32 and plan.num_prefix_tokens == 0
    assert [s.rope_delta for s in plan.segments] == [5, 5, 19, 19, 19]
    result = store.retrieve(plan)
    assert result.kv.shape[2] == a_at + 20
    assert torch.equal(result.kv[:, :, b_at : b_at + 12], kv_b)
    assert torch.equal(result.kv[:, :, a_at : a_at + 20], kv_a)
    store.flush()  # write-throughs pin their source slots until the disk writer is done
    assert memory_pins(store) == 0


def test_the_prefix_leg_gives_exact_segments_and_a_stored_partial_chunk_stays_exact(
    store: TieredStore, small_layout: KVLayout
) -> None:
    tokens, kv = make_tokens(20), make_kv(small_layout, 20)
    store.store(tokens, kv)
    plan = store.lookup(np.concatenate([tokens, [1, 2, 3]]))
    assert spans(plan) == [(0, 8, 0, True), (8, 16, 8, True), (16, 20, 16, True)]
    assert plan.num_prefix_tokens == 20 and [(g.start, g.end) for g in plan.gaps] == [(20, 23)]
    result = store.retrieve(plan)
    assert result.num_prefix_tokens == 20 and torch.equal(result.kv, kv)


def test_blend_can_be_turned_off_per_lookup_and_is_refused_without_the_index(
    tmp_path: Path, store: TieredStore, small_layout: KVLayout
) -> None:
    doc = make_tokens(16, seed=1)
    store.store(doc, make_kv(small_layout, 16, seed=1))
    prompt = np.concatenate([[9, 9, 9], doc])
    assert len(store.lookup(prompt).segments) == 2
    assert store.lookup(prompt, blend=False).segments == ()
    plain = config(tmp_path / "plain", small_layout, enable_blend=False)
    with TieredStore(small_layout, plain) as without_index, pytest.raises(ConfigError, match="enable_blend"):
        without_index.lookup(prompt, blend=True)
    with pytest.raises(ConfigError, match="needs enable_blend"):
        StoreConfig(enable_dedup_content=True)


# -- sessions -----------------------------------------------------------------------------------------------------


def test_ending_a_session_releases_every_plan_it_did_not_retrieve(store: TieredStore, small_layout: KVLayout) -> None:
    tokens = make_tokens(24)
    store.store(tokens, make_kv(small_layout, 24))
    store.flush()
    baseline = memory_pins(store)
    with store.session() as session:
        kept = session.lookup(tokens)
        session.lookup(tokens[:16])
        session.retrieve(session.lookup(tokens[:8]))
        assert memory_pins(store) == baseline + 3  # chunks pinned (two plans share the first two)
        assert store.stats().num_sessions == 1
    assert memory_pins(store) == baseline and store.stats().num_open_plans == 0
    with pytest.raises(ConfigError, match="session ended"):
        store.retrieve(kept)
    plan = store.lookup(tokens, session_id="request-7")
    store.end_session("request-7")
    store.end_session("request-7")  # idempotent
    assert memory_pins(store) == baseline
    store.release(plan)  # a plan of an ended session is already released


def test_an_abandoned_session_releases_its_pins_when_collected(store: TieredStore, small_layout: KVLayout) -> None:
    tokens = make_tokens(16)
    store.store(tokens, make_kv(small_layout, 16))
    store.flush()
    session = store.session()
    session.lookup(tokens)
    assert memory_pins(store) == 2
    del session
    gc.collect()
    assert memory_pins(store) == 0 and store.stats().num_open_plans == 0


def test_closing_the_store_with_open_sessions_leaves_nothing_pinned(tmp_path: Path, small_layout: KVLayout) -> None:
    store = TieredStore(small_layout, config(tmp_path, small_layout))
    tokens = make_tokens(16)
    store.store(tokens, make_kv(small_layout, 16))
    session = store.session()
    session.lookup(tokens)
    store.close()
    session.close()  # after the store: harmless
    assert store.stats().num_open_plans == 0


# -- prefetch -----------------------------------------------------------------------------------------------------


def test_disk_chunks_are_prefetched_into_the_cpu_tier_without_blocking_the_lookup(
    tmp_path: Path, small_layout: KVLayout
) -> None:
    cfg = config(tmp_path, small_layout, tiers=(TierName.CPU, TierName.DISK))
    tokens, kv = make_tokens(24), make_kv(small_layout, 24)
    with TieredStore(small_layout, cfg) as first:
        first.store(tokens, kv)
    with TieredStore(small_layout, cfg) as store:
        plan = store.lookup(tokens)
        assert [s.tier for s in plan.segments] == [TierName.DISK] * 3 and len(plan.prefetches) == 3
        assert plan.wait(timeout=30) and plan.ready
        assert all(future.result() for future in plan.prefetches)
        assert store.stats().tier(TierName.CPU).num_pinned == 3  # type: ignore[union-attr]
        assert torch.equal(store.retrieve(plan).kv, kv)
        assert memory_pins(store) == 0
        again = store.lookup(tokens)
        assert [s.tier for s in again.segments] == [TierName.CPU] * 3 and again.prefetches == ()
        store.release(again)


def test_a_plan_released_before_its_prefetch_lands_leaks_no_pin(tmp_path: Path, small_layout: KVLayout) -> None:
    cfg = config(tmp_path, small_layout, tiers=(TierName.CPU, TierName.DISK))
    tokens = make_tokens(40)
    with TieredStore(small_layout, cfg) as first:
        first.store(tokens, make_kv(small_layout, 40))
    with TieredStore(small_layout, cfg) as store:
        for _ in range(5):
            plan = store.lookup(tokens)
            store.release(plan)
            plan.wait(timeout=30)
            assert memory_pins(store) == 0


def test_a_full_cpu_tier_makes_the_retrieve_read_the_disk(tmp_path: Path, small_layout: KVLayout) -> None:
    cfg = config(
        tmp_path, small_layout, tiers=(TierName.CPU, TierName.DISK), cpu_capacity_bytes=small_layout.chunk_bytes(CHUNK)
    )
    tokens, kv = make_tokens(16), make_kv(small_layout, 16)
    with TieredStore(small_layout, cfg) as store:
        store.store(tokens, kv)
        store.flush()
        other = make_tokens(8, seed=5)
        store.store(other, make_kv(small_layout, 8, seed=5))
        holder = store.lookup(other)  # pins the only cpu slot
        plan = store.lookup(tokens)
        plan.wait(timeout=30)
        assert [s.tier for s in plan.segments] == [TierName.DISK] * 2
        assert not any(future.result() for future in plan.prefetches), "no room: the prefetch does not land"
        assert torch.equal(store.retrieve(plan).kv, kv)
        store.release(holder)


@pytest.mark.parametrize("segmented", [False, True])
def test_a_memory_only_retrieve_serves_memory_chunks_and_makes_disk_ones_gaps(
    tmp_path: Path, small_layout: KVLayout, segmented: bool
) -> None:
    cfg = config(tmp_path, small_layout, tiers=(TierName.CPU, TierName.DISK), enable_blend=False,
                 enable_segmented_prefix=segmented, cpu_capacity_bytes=3 * small_layout.chunk_bytes(CHUNK))  # fmt: skip
    tokens, kv = make_tokens(24), make_kv(small_layout, 24)
    with TieredStore(small_layout, cfg) as store:
        store.store(tokens, kv)
        store.flush()
        other = make_tokens(8, seed=5)
        store.store(other, make_kv(small_layout, 8, seed=5))  # takes the first chunk's cpu slot (least recent)
        store.flush()  # the write-through's pin goes
        holder = store.lookup(other)  # pinned: with the plan's own pins, no room is left for a prefetch
        plan = store.lookup(tokens)
        assert [s.tier for s in plan.segments] == [TierName.DISK, TierName.CPU, TierName.CPU]
        result = store.retrieve(plan, memory_only=True)
        if segmented:
            assert spans(result) == [(8, 16, 8, True), (16, 24, 16, True)]
            assert [(g.start, g.end) for g in result.gaps] == [(0, 8)]
            assert torch.equal(result.kv[:, :, 8:], kv[:, :, 8:])
        else:  # a gap at the front cuts the exact prefix there, as a chunk that fails to load does
            assert result.segments == () and result.num_prefix_tokens == 0
        plan.wait(timeout=30)
        store.release(holder)
        assert memory_pins(store) == 0 and store.stats().num_open_plans == 0
        assert torch.equal(store.retrieve(store.lookup(tokens)).kv, kv), "the disk chunk was skipped, not dropped"


def test_a_memory_only_retrieve_does_not_wait_and_its_prefetches_still_land(
    tmp_path: Path, small_layout: KVLayout
) -> None:
    cfg = config(tmp_path, small_layout, tiers=(TierName.CPU, TierName.DISK), enable_segmented_prefix=True)
    tokens, kv = make_tokens(40), make_kv(small_layout, 40)
    with TieredStore(small_layout, cfg) as first:
        first.store(tokens, kv)
    with TieredStore(small_layout, cfg) as store:
        plan = store.lookup(tokens)
        assert [s.tier for s in plan.segments] == [TierName.DISK] * 5
        result = store.retrieve(plan, memory_only=True)  # serves whatever landed already (none to all five)
        for segment in result.segments:
            assert torch.equal(result.kv[:, :, segment.start : segment.end], kv[:, :, segment.start : segment.end])
        assert plan.wait(timeout=30) and all(future.result() for future in plan.prefetches)
        assert memory_pins(store) == 0, "chunks landing after the retrieve are not left pinned"
        again = store.lookup(tokens)
        assert [s.tier for s in again.segments] == [TierName.CPU] * 5, "the skipped chunks landed for next time"
        assert torch.equal(store.retrieve(again, memory_only=True).kv, kv)


# -- registration ---------------------------------------------------------------------------------------------------


def test_registration_runs_off_the_store_path_and_shields_its_chunks(
    store: TieredStore, small_layout: KVLayout
) -> None:
    catalog = store._catalog
    assert catalog is not None
    doc = make_tokens(16, seed=1)
    with catalog.index._index_lock:  # hold the worker inside its registration (nothing here may use the index)
        result = store.store(doc, make_kv(small_layout, 16, seed=1))
        assert result.num_new_chunks == 2, "store returns while the registration waits"
        keys = prefix_keys(small_layout.namespace, as_token_array(doc), CHUNK)
        assert all(catalog._worker.is_pending(key) for key in keys)
        gpu = store._tiers.named(TierName.GPU)
        assert gpu is not None and gpu.stats().num_pinned == 2  # store.stats() would wait for the lock
        store.evict(keys)
        assert all(TierName.GPU in store.contains(key) for key in keys), "the shield keeps them resident"
    store.flush()
    assert memory_pins(store) == 0 and store.stats().catalog.registration.num_pending_jobs == 0  # type: ignore[union-attr]
    assert len(store.lookup(np.concatenate([[1, 2], doc])).segments) == 2


def test_a_lookup_sees_every_registration_submitted_before_it(store: TieredStore, small_layout: KVLayout) -> None:
    documents = [make_tokens(16, seed=seed) for seed in range(20)]
    for seed, doc in enumerate(documents):
        store.store(doc, make_kv(small_layout, 16, seed=seed))
        plan = store.lookup(np.concatenate([[3], doc]))
        assert plan.num_cached_tokens == 16, f"document {seed} stored just before was not found"
        store.release(plan)


def test_a_failed_registration_is_counted_and_the_worker_goes_on(small_layout: KVLayout) -> None:
    index = FingerprintIndex()
    worker = RegistrationWorker(index, CHUNK)
    doc = as_token_array(make_tokens(16, seed=1))
    keys = prefix_keys(small_layout.namespace, doc, CHUNK)
    answers: list[RegistrationResult | None] = []
    worker.submit(RegistrationJob(tokens=doc, keys=keys[:1], source_start=0, on_done=answers.append))  # 1 key, 2 chunks
    worker.submit(RegistrationJob(tokens=doc, keys=keys, source_start=0, on_done=answers.append))
    worker.wait_submitted()
    assert answers[0] is None and answers[1] is not None and answers[1].num_added == 2
    stats = worker.stats()
    assert (stats.num_failed_jobs, stats.num_jobs, stats.num_chunks_registered) == (1, 2, 2)
    worker.close()


def test_blend_refuses_chunks_too_long_for_the_index() -> None:
    with pytest.raises(ConfigError, match="too long for the content index"):
        StoreConfig(chunk_size=70_000, enable_blend=True)


# -- lazy two-strike eviction: one test per rule ------------------------------------------------------------------


def stored_then_gone(store: TieredStore, layout: KVLayout) -> tuple[np.ndarray, list[PrefixKey]]:  # type: ignore[type-arg]
    doc = make_tokens(16, seed=11)
    store.store(doc, make_kv(layout, 16, seed=11))
    store.flush()
    keys = prefix_keys(layout.namespace, as_token_array(doc), CHUNK)
    store.evict(keys)
    assert store.contains(keys[0]) == [] and keys[0] in store._catalog.index  # type: ignore[union-attr]
    return np.concatenate([[5, 5, 5], doc]), list(keys)


def test_rule_1_an_entry_whose_chunk_is_gone_is_removed_at_its_second_strike(
    store: TieredStore, small_layout: KVLayout
) -> None:
    prompt, keys = stored_then_gone(store, small_layout)
    catalog = store._catalog
    assert catalog is not None
    assert store.lookup(prompt).segments == ()
    assert catalog.strikes(keys[0]) == 1 and keys[0] in catalog.index, "one strike keeps the entry"
    store.lookup(prompt)
    assert keys[0] not in catalog.index and len(catalog.index) == 0
    stats = store.stats().catalog
    assert stats is not None and stats.num_struck_out == 2  # both chunks' entries


def test_rule_2_pending_entries_are_never_struck(small_layout: KVLayout) -> None:
    gone: set[bytes] = set()
    check = ResidencyCheck(is_resident=lambda key: key not in gone, in_transit=lambda key: False)
    catalog = ContentCatalog(CHUNK, check)
    doc = as_token_array(make_tokens(16, seed=3))
    keys = prefix_keys(small_layout.namespace, doc, CHUNK)
    gate = threading.Event()
    catalog.register(doc, keys, 0, on_done=gate.wait)  # indexed, but the job (and its keys) stay pending
    try:
        while len(catalog.index) < 2:
            threading.Event().wait(0.001)
        gone.update(keys)
        assert catalog.match(doc, skip=lambda m: False, pin=lambda key: None) == []
        assert catalog.strikes(keys[0]) == 0 and keys[0] in catalog.index
    finally:
        gate.set()
    catalog.sync()
    catalog.match(doc, skip=lambda m: False, pin=lambda key: None)
    assert catalog.strikes(keys[0]) == 1, "once registered, a missing chunk is struck"
    catalog.close()


def test_rule_3_a_capacity_miss_is_not_a_strike(small_layout: KVLayout) -> None:
    catalog = ContentCatalog(CHUNK, ResidencyCheck(is_resident=lambda key: False, in_transit=lambda key: True))
    doc = as_token_array(make_tokens(16, seed=4))
    keys = prefix_keys(small_layout.namespace, doc, CHUNK)
    catalog.register(doc, keys, 0, on_done=lambda: None)
    catalog.sync()
    for _ in range(3):
        catalog.match(doc, skip=lambda m: False, pin=lambda key: None)
    assert catalog.strikes(keys[0]) == 0 and len(catalog.index) == 2
    catalog.close()


def test_a_chunk_being_demoted_for_room_reports_in_transit(small_layout: KVLayout) -> None:
    seen: list[bool] = []
    tier: CpuTier

    def spill(record: ChunkRecord, kv: torch.Tensor) -> None:
        seen.append(tier.in_transit(record.key) and not tier.contains(record.key))

    tier = CpuTier(small_layout, CHUNK, small_layout.chunk_bytes(CHUNK), spill=spill)
    tokens = as_token_array(make_tokens(16))
    keys = prefix_keys(small_layout.namespace, tokens, CHUNK)
    for index, key in enumerate(keys):
        record = ChunkRecord(key=key, source_start=index * CHUNK, tokens=tokens[index * CHUNK : (index + 1) * CHUNK])
        assert tier.put(record, make_kv(small_layout, CHUNK, seed=index))
    assert seen == [True], "the victim is in transit (capacity), not absent, while it is spilled"
    assert not tier.in_transit(keys[0])
    tier.close()


def test_rule_4_a_chunk_found_again_clears_its_strikes(store: TieredStore, small_layout: KVLayout) -> None:
    prompt, keys = stored_then_gone(store, small_layout)
    catalog = store._catalog
    assert catalog is not None
    store.lookup(prompt)
    assert catalog.strikes(keys[0]) == 1
    store.store(prompt[3:], make_kv(small_layout, 16, seed=11))  # stored again
    assert catalog.strikes(keys[0]) == 0
    plan = store.lookup(prompt)
    assert len(plan.segments) == 2
    store.release(plan)
    store.evict(keys)
    store.lookup(prompt)
    assert keys[0] in catalog.index, "the count started over: one strike does not remove it"


# -- segmented prefix -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("segmented", [False, True])
def test_a_missing_chunk_in_the_prefix_is_a_gap_only_with_segmented_prefix(
    tmp_path: Path, small_layout: KVLayout, segmented: bool
) -> None:
    cfg = config(tmp_path, small_layout, enable_blend=False, enable_segmented_prefix=segmented)
    tokens, kv = make_tokens(32), make_kv(small_layout, 32)
    with TieredStore(small_layout, cfg) as store:
        store.store(tokens, kv)
        store.flush()
        keys = prefix_keys(small_layout.namespace, as_token_array(tokens), CHUNK)
        store.evict([keys[1]])
        plan = store.lookup(tokens)
        if not segmented:
            assert spans(plan) == [(0, 8, 0, True)]
            store.release(plan)
            return
        assert spans(plan) == [(0, 8, 0, True), (16, 24, 16, True), (24, 32, 24, True)]
        assert [(g.start, g.end) for g in plan.gaps] == [(8, 16)] and plan.num_prefix_tokens == 8
        result = store.retrieve(plan)
        assert torch.equal(result.kv[:, :, :8], kv[:, :, :8]) and torch.equal(result.kv[:, :, 16:], kv[:, :, 16:])


@pytest.mark.parametrize("segmented", [False, True])
def test_a_chunk_failing_its_checksum_at_retrieve_is_a_gap_or_cuts_the_prefix(
    tmp_path: Path, small_layout: KVLayout, segmented: bool
) -> None:
    cfg = config(tmp_path, small_layout, tiers=(TierName.DISK,), enable_blend=False, enable_segmented_prefix=segmented)
    tokens, kv = make_tokens(32), make_kv(small_layout, 32)
    with TieredStore(small_layout, cfg) as store:
        store.store(tokens, kv)
    keys = prefix_keys(small_layout.namespace, as_token_array(tokens), CHUNK)
    flip_frame_bit(cfg.data_dir, keys[1])
    with TieredStore(small_layout, cfg) as store:
        plan = store.lookup(tokens)
        assert len(plan.segments) == 4, "the meta is intact: the corruption shows only when the frame is read"
        result = store.retrieve(plan)
        if segmented:
            assert [s.start for s in result.segments] == [0, 16, 24]
            assert [(g.start, g.end) for g in result.gaps] == [(8, 16)]
            assert torch.equal(result.kv[:, :, 16:], kv[:, :, 16:])
        else:
            assert [s.start for s in result.segments] == [0] and result.kv.shape[2] == 8
        assert torch.equal(result.kv[:, :, :8], kv[:, :, :8])
        disk = store.stats().tier(TierName.DISK)
        assert disk is not None and disk.corrupt_reads == 1


# -- dedup-content ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dedup", [False, True])
def test_the_same_document_after_another_prefix_is_stored_once_with_dedup(
    tmp_path: Path, small_layout: KVLayout, dedup: bool
) -> None:
    cfg = config(tmp_path, small_layout, enable_dedup_content=dedup)
    doc = make_tokens(16, seed=1)
    first_prefix, second_prefix = make_tokens(8, seed=2), make_tokens(8, seed=3)
    first = np.concatenate([first_prefix, doc])
    second = np.concatenate([second_prefix, doc])
    kv_first, kv_second = make_kv(small_layout, 24, seed=1), make_kv(small_layout, 24, seed=2)
    with TieredStore(small_layout, cfg) as store:
        store.store(first, kv_first)
        result = store.store(second, kv_second)
        store.flush()
        disk = store.stats().tier(TierName.DISK)
        assert disk is not None
        if not dedup:
            assert (result.num_new_chunks, result.num_aliased_chunks, disk.num_chunks) == (3, 0, 6)
            return
        assert (result.num_new_chunks, result.num_aliased_chunks, disk.num_chunks) == (1, 2, 4)
        plan = store.lookup(np.concatenate([second, [1, 2]]))
        assert spans(plan) == [(0, 8, 0, True), (8, 16, 8, False), (16, 24, 16, False)], (
            "the prefix leg reaches the aliases and reports blend segments of the first copy"
        )
        first_keys = prefix_keys(small_layout.namespace, as_token_array(first), CHUNK)
        assert [s.key for s in plan.segments[1:]] == first_keys[1:]
        retrieved = store.retrieve(plan)
        assert torch.equal(retrieved.kv[:, :, 8:], kv_first[:, :, 8:])
        assert torch.equal(retrieved.kv[:, :, :8], kv_second[:, :, :8])
        assert store.store(second, kv_second).num_new_chunks == 0, "an alias counts as stored"


# -- threads --------------------------------------------------------------------------------------------------------


def test_threads_store_look_up_and_end_sessions_at_once(store: TieredStore, small_layout: KVLayout) -> None:
    documents = [(make_tokens(20, seed), make_kv(small_layout, 20, seed)) for seed in range(6)]
    errors: list[str] = []

    def worker(offset: int) -> None:
        for step in range(25):
            doc, kv = documents[(offset + step) % len(documents)]
            store.store(doc, kv)
            with store.session() as session:
                plan = session.lookup(np.concatenate([[offset, step], doc]))
                if step % 3 == 0:
                    continue  # abandoned inside the session: its end releases the pins
                result = session.retrieve(plan)
                for segment in result.segments:
                    want = kv[:, :, segment.source_start : segment.source_start + segment.num_tokens]
                    if not torch.equal(result.kv[:, :, segment.start : segment.end], want):
                        errors.append(f"worker {offset} step {step}: wrong KV at {segment.start}")

    run_in_threads(worker, 4)
    store.flush()
    assert errors == []
    assert store.stats().num_open_plans == 0 and memory_pins(store) == 0
