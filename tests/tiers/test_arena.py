"""The arena behind the cpu and gpu tiers, on real tensors (the gpu tier's logic runs here with device='cpu')."""

from __future__ import annotations

import pytest
import torch

from kvstore.errors import ConfigError, StoreClosedError
from kvstore.keys import as_token_array, prefix_keys
from kvstore.layout import KVLayout
from kvstore.tiers.arena import ArenaTier
from kvstore.tiers.base import ChunkRecord, TierName
from kvstore.tiers.cpu import CpuTier
from kvstore.tiers.gpu import GpuTier
from tests.factories import make_kv, make_tokens, run_in_threads

CHUNK = 8


def records(layout: KVLayout, num_tokens: int, seed: int = 0) -> list[ChunkRecord]:
    tokens = as_token_array(make_tokens(num_tokens, seed))
    keys = prefix_keys(layout.namespace, tokens, CHUNK)
    return [
        ChunkRecord(key=key, source_start=i * CHUNK, tokens=tokens[i * CHUNK : (i + 1) * CHUNK])
        for i, key in enumerate(keys)
    ]


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (the cpu twin runs everywhere)"
)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])])
def device(request: pytest.FixtureRequest) -> str:
    """Every arena test runs on host memory, and on a real GPU where there is one."""
    return str(request.param)


@pytest.fixture
def arena(small_layout: KVLayout, device: str):  # type: ignore[no-untyped-def]
    def build(num_slots: int, spill=None) -> ArenaTier:  # type: ignore[no-untyped-def]
        return GpuTier(
            small_layout, CHUNK, num_slots * small_layout.chunk_bytes(CHUNK), device=device, spill=spill
        )

    return build


def test_put_get_round_trip_including_a_partial_chunk(small_layout: KVLayout, arena) -> None:
    tier = arena(4)
    full, partial = records(small_layout, CHUNK + 3)
    kv_full, kv_partial = make_kv(small_layout, CHUNK, 1), make_kv(small_layout, 3, 2)
    assert tier.put(full, kv_full) and tier.put(partial, kv_partial)
    assert tier.num_tokens(partial.key) == 3
    out = torch.empty_like(kv_partial)
    assert tier.get_into(partial.key, out) and torch.equal(out, kv_partial)
    out = torch.empty_like(kv_full)
    assert tier.get_into(full.key, out) and torch.equal(out, kv_full)
    assert tier.stats().used_bytes == small_layout.chunk_bytes(CHUNK + 3)


def test_put_copies_so_the_caller_may_reuse_its_tensor(small_layout: KVLayout, arena) -> None:
    tier = arena(1)
    (record,) = records(small_layout, CHUNK)
    kv = make_kv(small_layout, CHUNK)
    expected = kv.clone()
    tier.put(record, kv)
    kv.fill_(7)
    out = torch.empty_like(kv)
    tier.get_into(record.key, out)
    assert torch.equal(out, expected)


def test_lru_eviction_order_and_spill(small_layout: KVLayout, arena) -> None:
    spilled: list[tuple[bytes, torch.Tensor]] = []
    tier = arena(3, spill=lambda record, view: spilled.append((record.key, view.cpu().clone())))
    chunks = records(small_layout, 5 * CHUNK)
    kvs = [make_kv(small_layout, CHUNK, seed) for seed in range(5)]
    for record, kv in zip(chunks[:3], kvs[:3], strict=True):
        tier.put(record, kv)
    tier.get_into(chunks[0].key, torch.empty_like(kvs[0]))  # 0 becomes most recent: LRU is now 1, 2, 0
    tier.put(chunks[3], kvs[3])
    tier.put(chunks[4], kvs[4])
    assert [key for key, _ in spilled] == [chunks[1].key, chunks[2].key]
    assert torch.equal(spilled[0][1], kvs[1]) and torch.equal(spilled[1][1], kvs[2])
    assert tier.keys() == [chunks[0].key, chunks[3].key, chunks[4].key]
    assert tier.stats().evictions == 2


def test_pinned_chunks_are_never_evicted_and_a_full_pinned_tier_rejects(
    small_layout: KVLayout, arena
) -> None:
    tier = arena(2)
    chunks = records(small_layout, 3 * CHUNK)
    for record in chunks[:2]:
        tier.put(record, make_kv(small_layout, CHUNK))
        assert tier.pin(record.key)
    assert tier.put(chunks[2], make_kv(small_layout, CHUNK)) is False
    assert tier.stats().rejected_puts == 1 and tier.stats().num_pinned == 2
    assert tier.evict(chunks[0].key) is False
    tier.unpin(chunks[0].key)
    assert tier.put(chunks[2], make_kv(small_layout, CHUNK))
    assert set(tier.keys()) == {chunks[1].key, chunks[2].key}


def test_pins_are_reference_counted(small_layout: KVLayout, arena) -> None:
    tier = arena(1)
    (record,) = records(small_layout, CHUNK)
    tier.put(record, make_kv(small_layout, CHUNK))
    tier.pin(record.key)
    tier.pin(record.key)
    tier.unpin(record.key)
    assert tier.evict(record.key) is False
    tier.unpin(record.key)
    assert tier.evict(record.key) is True
    assert tier.pin(record.key) is False


def test_evict_bytes_frees_least_recent_first(small_layout: KVLayout, arena) -> None:
    tier = arena(4)
    chunks = records(small_layout, 4 * CHUNK)
    for record in chunks:
        tier.put(record, make_kv(small_layout, CHUNK))
    freed = tier.evict_bytes(small_layout.chunk_bytes(CHUNK) + 1)
    assert freed == 2 * small_layout.chunk_bytes(CHUNK)
    assert tier.keys() == [chunks[2].key, chunks[3].key]


def test_failed_fill_frees_the_slot_and_hides_the_chunk(small_layout: KVLayout, arena) -> None:
    tier = arena(1)
    (record,) = records(small_layout, CHUNK)
    assert tier.put_with(record, lambda view: False) is False
    assert not tier.contains(record.key)
    assert tier.put(record, make_kv(small_layout, CHUNK))


def test_capacity_below_one_chunk_is_a_config_error(small_layout: KVLayout) -> None:
    with pytest.raises(ConfigError, match="below one chunk"):
        CpuTier(small_layout, CHUNK, small_layout.chunk_bytes(CHUNK) - 1)


def test_gpu_tier_without_cuda_says_what_to_do(small_layout: KVLayout) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the error path is for machines without it")
    with pytest.raises(ConfigError, match="--tiers cpu,disk"):
        GpuTier(small_layout, CHUNK, 10 * small_layout.chunk_bytes(CHUNK))


def test_use_after_close(small_layout: KVLayout, arena) -> None:
    tier = arena(1)
    tier.close()
    (record,) = records(small_layout, CHUNK)
    with pytest.raises(StoreClosedError):
        tier.put(record, make_kv(small_layout, CHUNK))
    assert tier.stats().tier is TierName.GPU


def test_concurrent_puts_and_gets_never_return_wrong_data(small_layout: KVLayout, arena) -> None:
    tier = arena(6)
    chunks = records(small_layout, 16 * CHUNK)
    kvs = [make_kv(small_layout, CHUNK, seed) for seed in range(16)]
    errors: list[str] = []

    def worker(offset: int) -> None:
        out = torch.empty_like(kvs[0])
        for step in range(200):
            index = (offset + step * 7) % 16
            tier.put(chunks[index], kvs[index])
            if tier.get_into(chunks[index].key, out) and not torch.equal(out, kvs[index]):
                errors.append(f"chunk {index} read back wrong")

    run_in_threads(worker, 4)
    assert errors == []
    stats = tier.stats()
    assert stats.num_chunks <= 6 and stats.num_pinned == 0
