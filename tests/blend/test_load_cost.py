"""Wait for the disk or recompute (``kvstore.blend.load_cost``): the estimates, the decision, and blends over a real
disk tier that read their chunks or compute them as the policy says."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvstore import ConfigError, StoreConfig, TieredStore
from kvstore.blend import BlendConfig, LayerwiseBlender
from kvstore.blend.load_cost import LoadCostModel, disk_bound_segments, skipped_token_layers
from kvstore.layout import KVLayout
from kvstore.models import RandomInitModel
from kvstore.plan import LookupPlan, Segment
from kvstore.tiers.base import TierName

CHUNK = 8
LAYOUT = KVLayout(model_id="test/cost", num_layers=4, num_kv_heads=2, head_dim=16)


def segment(start: int, tier: TierName, *, exact: bool = False, num_tokens: int = CHUNK) -> Segment:
    return Segment(start=start, num_tokens=num_tokens, key=bytes([start % 256]) * 16, source_start=0, exact=exact,
                   tier=tier)  # fmt: skip


def future(outcome: bool | Exception | None) -> concurrent.futures.Future[bool]:
    made: concurrent.futures.Future[bool] = concurrent.futures.Future()
    if isinstance(outcome, Exception):
        made.set_exception(outcome)
    elif outcome is not None:
        made.set_result(outcome)
    return made


def test_disk_bound_segments_are_the_disk_ones_whose_prefetch_has_not_landed() -> None:
    segments = (segment(0, TierName.CPU), segment(8, TierName.DISK), segment(16, TierName.DISK),
                segment(24, TierName.DISK), segment(32, TierName.DISK), segment(40, TierName.GPU))  # fmt: skip
    prefetches = (future(True), future(False), future(None), future(OSError("gone")))
    plan = LookupPlan(plan_id=1, session_id=None, num_query_tokens=48, segments=segments, prefetches=prefetches)
    assert [s.start for s in disk_bound_segments(plan)] == [16, 24, 32], "landed: served from the cpu tier"
    remote = LookupPlan(plan_id=2, session_id=None, num_query_tokens=48, segments=segments)  # a Client's plan
    assert [s.start for s in disk_bound_segments(remote)] == [8, 16, 24, 32]


def test_skipping_adds_every_later_layer_for_blend_tokens_and_every_layer_for_exact_ones() -> None:
    blend, exact = segment(0, TierName.DISK, num_tokens=10), segment(10, TierName.DISK, exact=True)
    count = skipped_token_layers([blend], num_layers=4, check_layer=1, recompute_ratio=0.15)
    assert count == round(10 * 0.85 * 2)  # layers 2 and 3, where 15% of them would have been computed anyway
    assert skipped_token_layers([blend, exact], num_layers=4, check_layer=1, recompute_ratio=0.15) == count + 8 * 4
    assert skipped_token_layers([blend], num_layers=4, check_layer=1, recompute_ratio=1.0) == 0


def test_the_model_waits_until_it_knows_both_rates_then_compares_the_estimates() -> None:
    model = LoadCostModel(LAYOUT, window=3)
    two_chunks = [segment(0, TierName.DISK), segment(8, TierName.DISK)]
    chunk_pair = 2 * LAYOUT.chunk_bytes(CHUNK)
    assert not model.recompute_is_faster(two_chunks, 1)
    model.observe_compute(1000, 10.0)  # 0.01 ms per token-layer
    assert not model.recompute_is_faster(two_chunks, 1), "no disk stall seen yet: wait"
    model.observe_disk_wait(chunk_pair, 5.0)  # reading these two chunks stalled 5 ms
    assert model.recompute_is_faster(two_chunks, 499) and not model.recompute_is_faster(two_chunks, 501)
    assert not model.recompute_is_faster([], 0)
    model.observe_disk_wait(0, 99.0)  # nothing was read from disk: nothing learnt
    model.observe_compute(0, 5.0)
    assert model.ms_per_byte == pytest.approx(5.0 / chunk_pair) and model.ms_per_token_layer == pytest.approx(0.01)


def test_one_odd_observation_moves_neither_estimate_and_a_lasting_change_does() -> None:
    model = LoadCostModel(LAYOUT, window=5)
    model.observe_compute(1000, 500.0)  # the first prompt: kernels compile, caches are cold
    for _ in range(2):
        model.observe_compute(1000, 10.0)
    assert model.ms_per_token_layer == pytest.approx(0.01)
    for _ in range(3):
        model.observe_compute(1000, 20.0)
    assert model.ms_per_token_layer == pytest.approx(0.02), "the oldest left the window"


@given(st.lists(st.tuples(st.integers(1, 10**9), st.floats(0.0, 1e4)), min_size=1, max_size=20))
def test_the_disk_estimate_stays_within_the_recent_rates(samples: list[tuple[int, float]]) -> None:
    model = LoadCostModel(LAYOUT, window=4)
    for num_bytes, stall_ms in samples:
        model.observe_disk_wait(num_bytes, stall_ms)
    recent = [stall_ms / num_bytes for num_bytes, stall_ms in samples[-4:]]
    assert model.ms_per_byte is not None and min(recent) <= model.ms_per_byte <= max(recent)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="window=0 must be at least 1"):
        LoadCostModel(LAYOUT, window=0)
    with pytest.raises(ConfigError, match="disk_policy='sometimes' is not one of auto, wait, recompute"):
        BlendConfig(disk_policy="sometimes")  # type: ignore[arg-type]


# -- blends over a real disk tier ----------------------------------------------------------------------------------


def documents() -> list[list[int]]:
    rng = np.random.default_rng(4)
    return [rng.integers(3, 500, 27).tolist() for _ in range(3)]


def prompt_of(docs: list[list[int]]) -> list[int]:
    return [1, 2, 3] + docs[2] + [4] + docs[0] + [5] + docs[1] + [6, 7]


def disk_blender(model: RandomInitModel, path: Path, config: BlendConfig) -> tuple[TieredStore, LayerwiseBlender]:
    store_config = StoreConfig(tiers=(TierName.DISK,), chunk_size=CHUNK, data_dir=path / "data",
                               disk_capacity_bytes=64 << 20, enable_blend=True)  # fmt: skip
    store = TieredStore(model.layout, store_config)
    return store, LayerwiseBlender(model.model, store, config)


def test_recompute_computes_what_only_the_disk_holds_and_wait_reads_it(tiny_llama: RandomInitModel,
                                                                       tmp_path: Path) -> None:  # fmt: skip
    store, blender = disk_blender(tiny_llama, tmp_path, BlendConfig(disk_policy="recompute"))
    with store, blender:
        docs = documents()
        for doc in docs:
            blender.prefill(doc, mode="full")
        store.flush()
        prompt = prompt_of(docs)
        full = blender.prefill(prompt, mode="full", store_result=False)
        skipped = blender.prefill(prompt, store_result=False)
        assert skipped.num_skipped_disk_tokens == 81 and skipped.plan.num_blend_tokens == 0
        assert skipped.num_recomputed_tokens == len(prompt)  # every token computed: a full prefill's result
        torch.testing.assert_close(skipped.logits, full.logits, rtol=0, atol=1e-5)
        read = blender.prefill(prompt, store_result=False, config=BlendConfig(disk_policy="wait"))
        assert read.num_skipped_disk_tokens == 0 and read.plan.num_blend_tokens == 81
        assert read.num_recomputed_tokens < len(prompt)
        assert store.stats().num_open_plans == 0


def test_auto_reads_until_it_has_measured_then_follows_the_estimates(tiny_llama: RandomInitModel,
                                                                    tmp_path: Path) -> None:  # fmt: skip
    store, blender = disk_blender(tiny_llama, tmp_path, BlendConfig())
    with store, blender:
        docs = documents()
        for doc in docs:
            blender.prefill(doc, mode="full")
        store.flush()
        costs = blender.load_costs
        assert costs.ms_per_token_layer is not None and costs.ms_per_byte is None, "full prefills teach compute"
        prompt = prompt_of(docs)
        first = blender.prefill(prompt, store_result=False)
        assert first.num_skipped_disk_tokens == 0 and first.plan.num_blend_tokens == 81, "nothing known: it reads"
        assert costs.ms_per_byte is not None, "a blend that read the disk teaches the disk's rate"
        blender.load_costs = slow_disk = LoadCostModel(tiny_llama.layout, window=1)
        slow_disk.observe_disk_wait(1, 1.0)  # a disk far slower than compute
        slow_disk.observe_compute(10**9, 1.0)
        assert blender.prefill(prompt, store_result=False).num_skipped_disk_tokens == 81
        slow_disk.observe_disk_wait(10**12, 1.0)  # now compute far slower than the disk
        slow_disk.observe_compute(1, 1.0)
        assert blender.prefill(prompt, store_result=False).num_skipped_disk_tokens == 0
