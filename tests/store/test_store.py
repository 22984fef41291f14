"""TieredStore on real tiers: the gpu tier's logic on host memory (device='cpu'), the cpu arena, real LMDB."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstore import (
    ConfigError,
    InvalidInputError,
    KVLayout,
    LayoutMismatchError,
    StoreClosedError,
    TieredStore,
)
from kvstore.config import StoreConfig
from kvstore.keys import prefix_keys
from kvstore.plan import ChunkOutcome
from kvstore.tiers.base import TierName
from tests.factories import make_kv, make_tokens, run_in_threads, store_config

CHUNK = 8


def config(tmp_path: Path, layout: KVLayout, **changes: object) -> StoreConfig:
    return store_config(tmp_path, layout, CHUNK, gpu_chunks=4, cpu_chunks=8, **changes)


@pytest.fixture
def store(tmp_path: Path, small_layout: KVLayout) -> Iterator[TieredStore]:
    with TieredStore(small_layout, config(tmp_path, small_layout)) as opened:
        yield opened


def test_round_trip_with_a_partial_last_chunk(store: TieredStore, small_layout: KVLayout) -> None:
    tokens, kv = make_tokens(20), make_kv(small_layout, 20)
    result = store.store(tokens, kv)
    assert (result.num_chunks, result.num_new_chunks) == (3, 3)
    assert store.store(tokens, kv).num_new_chunks == 0
    lookup = store.lookup(tokens)
    assert lookup.num_cached_tokens == 20
    assert [chunk.num_tokens for chunk in lookup.segments] == [8, 8, 4]
    retrieved = store.retrieve(lookup)
    assert retrieved.num_prefix_tokens == 20 and torch.equal(retrieved.kv, kv)


def test_lookup_stops_at_the_first_missing_chunk(store: TieredStore, small_layout: KVLayout) -> None:
    tokens, kv = make_tokens(20), make_kv(small_layout, 20)
    store.store(tokens, kv)
    longer = [*tokens.tolist(), 1, 2, 3]
    lookup = store.lookup(longer)
    assert lookup.num_cached_tokens == 16, "the stored partial chunk's key must not match a longer chunk"
    assert torch.equal(store.retrieve(lookup).kv, kv[:, :, :16])
    other = store.lookup(make_tokens(20, seed=9))
    assert other.segments == () and store.retrieve(other).num_prefix_tokens == 0


def test_retrieve_into_a_caller_buffer_returns_a_view(store: TieredStore, small_layout: KVLayout) -> None:
    tokens, kv = make_tokens(16), make_kv(small_layout, 16)
    store.store(tokens, kv)
    out = torch.full(small_layout.chunk_shape(24), 3.0, dtype=torch.bfloat16)
    result = store.retrieve(store.lookup(tokens), out)
    assert result.kv.data_ptr() == out.data_ptr()
    assert torch.equal(out[:, :, :16], kv) and bool((out[:, :, 16:] == 3.0).all())
    with pytest.raises(InvalidInputError, match="cannot hold"):
        store.retrieve(store.lookup(tokens), out[:, :, :8])


def test_gpu_eviction_demotes_to_cpu_and_hits_promote_back(tmp_path: Path, small_layout: KVLayout) -> None:
    cfg = config(tmp_path, small_layout, tiers=(TierName.GPU, TierName.CPU))
    with TieredStore(small_layout, cfg) as store:
        tokens, kv = make_tokens(6 * CHUNK), make_kv(small_layout, 6 * CHUNK)
        store.store(tokens, kv)  # 6 chunks into a 4-slot gpu tier: the 2 oldest are demoted to cpu
        lookup = store.lookup(tokens)
        assert [chunk.tier for chunk in lookup.segments] == [TierName.CPU] * 2 + [TierName.GPU] * 4
        assert torch.equal(store.retrieve(lookup).kv, kv)
        again = store.lookup(tokens)
        assert [chunk.tier for chunk in again.segments] == [TierName.GPU] * 2 + [TierName.CPU] * 2 + [
            TierName.GPU
        ] * 2, "cpu hits are promoted into the gpu tier, demoting its least recently used chunks"
        assert torch.equal(store.retrieve(again).kv, kv)


def test_without_a_cpu_tier_gpu_victims_go_to_the_disk_and_are_read_from_it(
    tmp_path: Path, small_layout: KVLayout
) -> None:
    """The tiers are a list: a tier's victims spill into the next one, whichever it is."""
    cfg = config(tmp_path, small_layout, tiers=(TierName.GPU, TierName.DISK))
    with TieredStore(small_layout, cfg) as store:
        tokens, kv = make_tokens(4 * CHUNK), make_kv(small_layout, 4 * CHUNK)
        store.store(tokens, kv)  # the 4-slot gpu tier is full
        store.flush()  # the write-throughs are done with their gpu slots
        store.store(make_tokens(2 * CHUNK, 1), make_kv(small_layout, 2 * CHUNK, 1))  # the 2 oldest leave the gpu
        lookup = store.lookup(tokens)
        assert [chunk.tier for chunk in lookup.segments] == [TierName.DISK] * 2 + [TierName.GPU] * 2
        assert torch.equal(store.retrieve(lookup).kv, kv)
        again = store.lookup(tokens)
        assert [chunk.tier for chunk in again.segments] == [TierName.DISK] * 2 + [TierName.GPU] * 2, (
            "without a cpu tier nothing lands in memory to promote"
        )
        store.release(again)


def test_a_hit_is_a_chunk_a_lookup_planned_from_a_tier(tmp_path: Path, small_layout: KVLayout) -> None:
    """The one definition of ``TierStats.hits``: counted at lookup, by the tier the chunk is planned from."""
    cfg = config(tmp_path, small_layout, tiers=(TierName.GPU, TierName.CPU))
    with TieredStore(small_layout, cfg) as store:
        tokens = make_tokens(6 * CHUNK)
        store.store(tokens, make_kv(small_layout, 6 * CHUNK))  # 2 chunks demoted to cpu, 4 stay on the gpu tier
        store.release(store.lookup(tokens))  # planned only, never read: still 2 cpu hits and 4 gpu hits
        store.release(store.lookup(make_tokens(2 * CHUNK, seed=99)))  # 2 chunks no tier has
        gpu, cpu = store.stats().tiers
        assert (gpu.hits, gpu.misses, cpu.hits, cpu.misses) == (4, 4, 2, 6)
        assert cpu.hit_ratio == 2 / 8 and gpu.hit_ratio + cpu.hit_ratio == 6 / 8


def test_evict_refuses_what_names_nothing_and_takes_tier_names(tmp_path: Path, small_layout: KVLayout) -> None:
    with TieredStore(small_layout, config(tmp_path, small_layout, tiers=(TierName.CPU,))) as store:
        store.store(make_tokens(2 * CHUNK), make_kv(small_layout, 2 * CHUNK))
        with pytest.raises(InvalidInputError, match="16-byte chunk key"):
            store.evict([b"short"])  # type: ignore[list-item]
        with pytest.raises(InvalidInputError, match="non-negative"):
            store.evict_bytes(-5, "cpu")
        with pytest.raises(ConfigError, match="no disk tier"):
            store.evict_bytes(1, "disk")
        with pytest.raises(ConfigError, match="not one of gpu, cpu, disk"):
            store.evict_bytes(1, "dsk")
        assert store.evict_bytes(1, "cpu") == small_layout.chunk_bytes(CHUNK), "a plain string names the tier"


def test_write_through_releases_its_pins_once_flushed(tmp_path: Path, small_layout: KVLayout) -> None:
    cfg = config(tmp_path, small_layout, tiers=(TierName.CPU, TierName.DISK))
    with TieredStore(small_layout, cfg) as store:
        tokens = make_tokens(3 * CHUNK)
        store.store(tokens, make_kv(small_layout, 3 * CHUNK))
        store.flush()
        stats = store.stats()
        assert stats.tier(TierName.CPU).num_pinned == 0  # type: ignore[union-attr]
        assert stats.tier(TierName.DISK).num_chunks == 3  # type: ignore[union-attr]


def test_write_through_survives_a_restart(tmp_path: Path, small_layout: KVLayout) -> None:
    tokens, kv = make_tokens(5 * CHUNK + 3), make_kv(small_layout, 5 * CHUNK + 3)
    with TieredStore(small_layout, config(tmp_path, small_layout)) as first:
        first.store(tokens, kv)
    with TieredStore(small_layout, config(tmp_path, small_layout)) as second:
        lookup = second.lookup(tokens)
        assert lookup.num_tokens_in(TierName.DISK) == len(tokens)
        assert torch.equal(second.retrieve(lookup).kv, kv)
        promoted = second.lookup(tokens)
        assert promoted.num_tokens_in(TierName.DISK) == 0, "disk hits are promoted into memory tiers"
        second.release(promoted)


def test_disk_only_store_reads_its_own_pending_writes(tmp_path: Path, small_layout: KVLayout) -> None:
    with TieredStore(small_layout, config(tmp_path, small_layout, tiers=(TierName.DISK,))) as store:
        tokens, kv = make_tokens(3 * CHUNK), make_kv(small_layout, 3 * CHUNK)
        store.store(tokens, kv)
        assert torch.equal(store.retrieve(store.lookup(tokens)).kv, kv)
        store.flush()
        assert torch.equal(store.retrieve(store.lookup(tokens)).kv, kv)


def test_cpu_eviction_keeps_chunks_on_disk(tmp_path: Path, small_layout: KVLayout) -> None:
    cfg = config(
        tmp_path,
        small_layout,
        tiers=(TierName.CPU, TierName.DISK),
        cpu_capacity_bytes=2 * small_layout.chunk_bytes(CHUNK),
    )
    with TieredStore(small_layout, cfg) as store:
        tokens, kv = make_tokens(6 * CHUNK), make_kv(small_layout, 6 * CHUNK)
        store.store(tokens, kv)
        store.flush()
        lookup = store.lookup(tokens)
        assert lookup.num_cached_tokens == 6 * CHUNK and lookup.num_tokens_in(TierName.DISK) >= 4 * CHUNK
        assert torch.equal(store.retrieve(lookup).kv, kv)


def test_lookup_pins_until_retrieve_or_release(store: TieredStore, small_layout: KVLayout) -> None:
    tokens = make_tokens(2 * CHUNK)
    store.store(tokens, make_kv(small_layout, 2 * CHUNK))
    store.flush()  # the disk writer's own pins are gone
    first, second = store.lookup(tokens), store.lookup(tokens)
    assert store.stats().num_open_plans == 2
    assert store.stats().tier(TierName.GPU).num_pinned == 2  # type: ignore[union-attr]
    store.retrieve(first)
    store.release(second)
    store.release(second)  # idempotent
    assert store.stats().num_open_plans == 0
    assert all(tier.num_pinned == 0 for tier in store.stats().tiers if tier.tier is not TierName.DISK)
    with pytest.raises(ConfigError, match="already retrieved or released"):
        store.retrieve(first)


def test_pinned_chunks_survive_eviction_pressure(tmp_path: Path, small_layout: KVLayout) -> None:
    cfg = config(
        tmp_path, small_layout, tiers=(TierName.CPU,), cpu_capacity_bytes=2 * small_layout.chunk_bytes(CHUNK)
    )
    with TieredStore(small_layout, cfg) as store:
        tokens, kv = make_tokens(CHUNK), make_kv(small_layout, CHUNK)
        store.store(tokens, kv)
        lookup = store.lookup(tokens)
        store.store(make_tokens(CHUNK, 1), make_kv(small_layout, CHUNK, 1))
        result = store.store(make_tokens(2 * CHUNK, 2), make_kv(small_layout, 2 * CHUNK, 2))
        assert result.num_rejected_chunks == 0
        assert torch.equal(store.retrieve(lookup).kv, kv)


def test_everything_pinned_rejects_instead_of_raising(tmp_path: Path, small_layout: KVLayout) -> None:
    cfg = config(
        tmp_path, small_layout, tiers=(TierName.CPU,), cpu_capacity_bytes=small_layout.chunk_bytes(CHUNK)
    )
    with TieredStore(small_layout, cfg) as store:
        tokens = make_tokens(CHUNK)
        store.store(tokens, make_kv(small_layout, CHUNK))
        lookup = store.lookup(tokens)
        result = store.store(make_tokens(CHUNK, 1), make_kv(small_layout, CHUNK, 1))
        assert (result.num_new_chunks, result.num_rejected_chunks) == (0, 1)
        store.release(lookup)


def test_store_result_says_what_happened_to_each_chunk(tmp_path: Path, small_layout: KVLayout) -> None:
    """Each chunk handed over, with its key, its place and its outcome; the counts follow from them."""
    cfg = config(
        tmp_path, small_layout, tiers=(TierName.CPU,), cpu_capacity_bytes=3 * small_layout.chunk_bytes(CHUNK)
    )
    with TieredStore(small_layout, cfg) as store:
        tokens, kv = make_tokens(2 * CHUNK + 4), make_kv(small_layout, 2 * CHUNK + 4)
        first = store.store(tokens[:CHUNK], kv[:, :, :CHUNK])
        assert [chunk.outcome for chunk in first.chunks] == [ChunkOutcome.WRITTEN]
        keys = prefix_keys(small_layout.namespace, tokens, CHUNK)
        lookup = store.lookup(tokens[:CHUNK])  # pins chunk 0: two free slots are left
        result = store.store(tokens, kv)
        assert [(chunk.key, chunk.start, chunk.end, chunk.outcome) for chunk in result.chunks] == [
            (keys[0], 0, CHUNK, ChunkOutcome.HELD),
            (keys[1], CHUNK, 2 * CHUNK, ChunkOutcome.WRITTEN),
            (keys[2], 2 * CHUNK, 2 * CHUNK + 4, ChunkOutcome.WRITTEN),
        ]
        assert (result.num_chunks, result.num_new_chunks, result.num_rejected_chunks) == (3, 2, 0)
        tail = store.store(tokens, kv[:, :, CHUNK:], start=CHUNK)
        assert [(chunk.start, chunk.outcome) for chunk in tail.chunks] == [
            (CHUNK, ChunkOutcome.HELD),
            (2 * CHUNK, ChunkOutcome.HELD),
        ], "a store from start lists only the chunks handed over"
        every_chunk = store.lookup(tokens)  # every slot pinned now
        other = store.store(make_tokens(CHUNK, 3), make_kv(small_layout, CHUNK, 3))
        assert [chunk.outcome for chunk in other.chunks] == [ChunkOutcome.REJECTED]
        assert (other.num_new_chunks, other.num_rejected_chunks) == (0, 1)
        store.release(every_chunk)
        store.release(lookup)


@pytest.mark.parametrize(
    ("make_bad", "message"),
    [
        (lambda layout: (make_tokens(8), make_kv(layout, 9)), "9 tokens but 8 token ids"),
        (lambda layout: (make_tokens(8), make_kv(layout, 8).float()), "dtype"),
        (lambda layout: (make_tokens(8), make_kv(layout, 8)[0]), "shape"),
        (lambda layout: (make_tokens(8), make_kv(layout, 8).to("meta")), "device"),
        (lambda layout: ([-1] * 8, make_kv(layout, 8)), "token ids"),
    ],
)
def test_bad_input_is_a_clear_error(
    store: TieredStore, small_layout: KVLayout, make_bad, message: str
) -> None:  # type: ignore[no-untyped-def]
    tokens, kv = make_bad(small_layout)
    with pytest.raises(InvalidInputError, match=message):
        store.store(tokens, kv)
    assert store.stats().tier(TierName.GPU).num_chunks == 0  # type: ignore[union-attr]


def test_reopening_with_another_layout_is_refused(tmp_path: Path, small_layout: KVLayout) -> None:
    with TieredStore(small_layout, config(tmp_path, small_layout)) as store:
        store.store(make_tokens(CHUNK), make_kv(small_layout, CHUNK))
    other = dataclasses.replace(small_layout, num_layers=6)
    with pytest.raises(LayoutMismatchError):
        TieredStore(other, config(tmp_path, other))


def test_closed_store_refuses_work_and_releases_pins(tmp_path: Path, small_layout: KVLayout) -> None:
    store = TieredStore(small_layout, config(tmp_path, small_layout))
    tokens = make_tokens(CHUNK)
    store.store(tokens, make_kv(small_layout, CHUNK))
    lookup = store.lookup(tokens)
    store.close()
    store.close()
    with pytest.raises(StoreClosedError):
        store.lookup(tokens)
    with pytest.raises(StoreClosedError):
        store.retrieve(lookup)


def test_threads_store_and_retrieve_at_once(store: TieredStore, small_layout: KVLayout) -> None:
    sequences = [(make_tokens(3 * CHUNK, seed), make_kv(small_layout, 3 * CHUNK, seed)) for seed in range(6)]
    errors: list[str] = []

    def worker(offset: int) -> None:
        for step in range(30):
            tokens, kv = sequences[(offset + step) % len(sequences)]
            store.store(tokens, kv)
            result = store.retrieve(store.lookup(tokens))
            if not torch.equal(result.kv, kv[:, :, : result.num_prefix_tokens]):
                errors.append(f"worker {offset} step {step}: wrong KV")

    run_in_threads(worker, 4)
    assert errors == []
    assert store.stats().num_open_plans == 0


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (the device='cpu' twins above run everywhere)"
)
def test_real_gpu_tier_demotes_promotes_and_round_trips(tmp_path: Path, small_layout: KVLayout) -> None:
    with TieredStore(small_layout, config(tmp_path, small_layout, gpu_device="cuda")) as store:
        tokens, kv = make_tokens(6 * CHUNK), make_kv(small_layout, 6 * CHUNK).cuda()
        store.store(tokens, kv)
        store.flush()
        lookup = store.lookup(tokens)
        assert {chunk.tier for chunk in lookup.segments} == {TierName.GPU, TierName.CPU}
        result = store.retrieve(lookup, device="cuda")
        assert result.kv.is_cuda and torch.equal(result.kv, kv)
    with TieredStore(small_layout, config(tmp_path, small_layout, gpu_device="cuda")) as reopened:
        assert torch.equal(reopened.retrieve(reopened.lookup(tokens), device="cuda").kv, kv)


def test_disk_staging_is_preallocated_only_when_no_cpu_tier_lends_its_slots(
    tmp_path: Path, small_layout: KVLayout
) -> None:
    with TieredStore(small_layout, config(tmp_path / "a", small_layout)) as with_cpu:
        assert with_cpu._tiers.durable is not None and with_cpu._tiers.durable._staging.num_allocated == 0
    disk_only = config(tmp_path / "b", small_layout, tiers=(TierName.DISK,))
    with TieredStore(small_layout, disk_only) as store:
        assert store._tiers.durable is not None
        assert store._tiers.durable._staging.num_allocated == store._tiers.durable._staging.max_buffers
