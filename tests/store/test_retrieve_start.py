"""``retrieve(start=...)``: the caller holds the prompt's tokens ``[0, start)`` already (an engine's own prefix
cache), so only ``[start, end)`` is loaded into a buffer that holds just those; a segment that straddles ``start``
gives its tail, from memory and from disk alike."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import InvalidInputError, KVLayout, TieredStore
from kvstore.tiers.base import TierName
from tests.factories import flip_frame_bit, make_kv, make_tokens, store_config

CHUNK = 8
NUM_TOKENS = 5 * CHUNK + 3
UNWRITTEN = 7.0


@pytest.fixture(params=["memory", "disk"])
def store(request: pytest.FixtureRequest, tmp_path: Path, small_layout: KVLayout) -> Iterator[TieredStore]:
    """A store whose chunks sit in the cpu tier (copied from pinned views), or on disk only (decoded)."""
    tiers = (TierName.CPU, TierName.DISK) if request.param == "memory" else (TierName.DISK,)
    config = store_config(tmp_path, small_layout, CHUNK, gpu_chunks=0, cpu_chunks=16, tiers=tiers)
    with TieredStore(small_layout, config) as opened:
        yield opened


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(start=st.integers(0, NUM_TOKENS), into_buffer=st.booleans())
def test_a_retrieve_from_start_loads_exactly_the_tokens_after_it(
    store: TieredStore, small_layout: KVLayout, start: int, into_buffer: bool
) -> None:
    tokens, kv = make_tokens(NUM_TOKENS, seed=3), make_kv(small_layout, NUM_TOKENS, seed=3)
    store.store(tokens, kv)
    store.flush()
    plan = store.lookup(tokens)
    out = (
        torch.full(small_layout.chunk_shape(NUM_TOKENS - start + 2), UNWRITTEN, dtype=small_layout.dtype.torch_dtype)
        if into_buffer
        else None
    )
    result = store.retrieve(plan, out, start=start)
    assert result.start == start
    assert torch.equal(result.kv, kv[:, :, start:]), "token start + i lands at index i"
    assert [segment.key for segment in result.segments] == [s.key for s in plan.segments if s.end > start]
    assert result.num_prefix_tokens == NUM_TOKENS and result.gaps == ()
    if out is not None:
        assert result.kv.numel() == 0 or result.kv.data_ptr() == out.data_ptr()
        assert bool((out[:, :, NUM_TOKENS - start :] == UNWRITTEN).all()), "nothing past the plan is written"


def test_a_buffer_sized_for_the_tail_is_enough_and_a_shorter_one_is_refused(
    store: TieredStore, small_layout: KVLayout
) -> None:
    tokens, kv = make_tokens(NUM_TOKENS, seed=4), make_kv(small_layout, NUM_TOKENS, seed=4)
    store.store(tokens, kv)
    store.flush()
    start = 2 * CHUNK + 1
    with pytest.raises(InvalidInputError, match="cannot hold"):
        store.retrieve(
            store.lookup(tokens),
            torch.empty(small_layout.chunk_shape(NUM_TOKENS - start - 1), dtype=small_layout.dtype.torch_dtype),
            start=start,
        )
    out = torch.empty(small_layout.chunk_shape(NUM_TOKENS - start), dtype=small_layout.dtype.torch_dtype)
    assert torch.equal(store.retrieve(store.lookup(tokens), out, start=start).kv, kv[:, :, start:])


def test_a_start_outside_the_plan_is_refused_and_its_pins_stay_for_a_retry(
    store: TieredStore, small_layout: KVLayout
) -> None:
    tokens, kv = make_tokens(NUM_TOKENS, seed=5), make_kv(small_layout, NUM_TOKENS, seed=5)
    store.store(tokens, kv)
    plan = store.lookup(tokens)
    for start in (-1, NUM_TOKENS + 1):
        with pytest.raises(InvalidInputError, match=f"start {start} is outside"):
            store.retrieve(plan, start=start)
    assert torch.equal(store.retrieve(plan, start=NUM_TOKENS).kv, kv[:, :, :0]), "the plan was not consumed"


def test_a_corrupt_chunk_the_caller_holds_is_never_read(tmp_path: Path, small_layout: KVLayout) -> None:
    """Below ``start`` nothing is read, so a damaged frame there neither fails the load nor cuts the prefix."""
    config = store_config(tmp_path, small_layout, CHUNK, gpu_chunks=0, cpu_chunks=16, tiers=(TierName.DISK,))
    tokens, kv = make_tokens(NUM_TOKENS, seed=6), make_kv(small_layout, NUM_TOKENS, seed=6)
    with TieredStore(small_layout, config) as store:
        store.store(tokens, kv)
        store.flush()
        damaged = store.lookup(tokens).segments[1]
    flip_frame_bit(config.data_dir, damaged.key)
    with TieredStore(small_layout, config) as store:
        held = store.retrieve(store.lookup(tokens), start=damaged.end)
        assert held.num_prefix_tokens == NUM_TOKENS and torch.equal(held.kv, kv[:, :, damaged.end :])
        straddled = store.retrieve(store.lookup(tokens), start=damaged.start + 1)
        assert straddled.num_prefix_tokens == damaged.start + 1, "the damaged chunk straddling start is a gap"
        assert straddled.segments == (), "without segmented prefix the exact segments after it go too"
