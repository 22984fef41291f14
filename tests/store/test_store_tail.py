"""``TieredStore.store(tokens, kv, start=...)``: storing only the tail of a sequence after its head.

The contract: a head stored first and the tail stored with ``start`` leave the store as one store of the whole
sequence does -- the same prefix lookups, the same content (blend) lookups, the same bytes back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import InvalidInputError, KVLayout, TieredStore
from kvstore.config import StoreConfig
from kvstore.keys import as_token_array, prefix_keys
from kvstore.plan import ChunkOutcome, LookupPlan
from kvstore.tiers.base import TierName
from tests.factories import make_kv, make_tokens, store_config

CHUNK = 8
LAYOUT = KVLayout(model_id="test/tail", num_layers=2, num_kv_heads=2, head_dim=8)


def config(tmp_path: Path, **changes: object) -> StoreConfig:
    return store_config(tmp_path, LAYOUT, CHUNK, gpu_chunks=4, cpu_chunks=16, **changes)


def memory_config(**changes: object) -> StoreConfig:
    """A cpu tier only: cheap enough to open two stores per hypothesis example."""
    settings_: dict[str, object] = {
        "tiers": (TierName.CPU,),
        "chunk_size": CHUNK,
        "cpu_capacity_bytes": 64 * LAYOUT.chunk_bytes(CHUNK),
        "enable_blend": True,
    }
    return StoreConfig(**{**settings_, **changes})  # type: ignore[arg-type]


def shape_of(plan: LookupPlan) -> list[tuple[int, int, bytes, int, bool]]:
    """A plan's segments without the tier (which the two stores may place differently)."""
    return [(s.start, s.num_tokens, bytes(s.key), s.source_start, s.exact) for s in plan.segments]


def served_kv(store: TieredStore, plan: LookupPlan) -> list[torch.Tensor]:
    """The KV a retrieve serves for each segment (a gap's bytes are left unwritten, so they are not compared)."""
    kv = store.retrieve(plan).kv
    return [kv[:, :, segment.start : segment.end] for segment in plan.segments]


def head_then_tail(store: TieredStore, tokens: npt.NDArray[np.int64], kv: torch.Tensor, start: int) -> None:
    store.store(tokens[:start], kv[:, :, :start])
    store.store(tokens, kv[:, :, start:].clone(), start=start)  # a copy: the tail's KV only, as a connector sends


@contextlib.contextmanager
def two_stores(split_config: StoreConfig, whole_config: StoreConfig) -> Iterator[tuple[TieredStore, TieredStore]]:
    """(split, whole): one store to feed head then tail, one to feed the whole sequence."""
    with TieredStore(LAYOUT, split_config) as split, TieredStore(LAYOUT, whole_config) as whole:
        yield split, whole


def disk_stores(tmp_path: Path, **changes: object) -> contextlib.AbstractContextManager[tuple[TieredStore, ...]]:
    return two_stores(config(tmp_path / "split", **changes), config(tmp_path / "whole", **changes))


def test_tail_after_head_serves_what_a_whole_store_serves(tmp_path: Path) -> None:
    tokens, kv = make_tokens(5 * CHUNK + 3, seed=1), make_kv(LAYOUT, 5 * CHUNK + 3, seed=1)
    with disk_stores(tmp_path, enable_blend=True) as (split, whole):
        split.store(tokens[: 2 * CHUNK], kv[:, :, : 2 * CHUNK])
        result = split.store(tokens, kv[:, :, 2 * CHUNK :].clone(), start=2 * CHUNK)
        assert (result.num_chunks, result.num_new_chunks) == (4, 4), "counted over the chunks handed over"
        whole.store(tokens, kv)
        for prompt in (tokens, np.concatenate([tokens, make_tokens(5, seed=2)])):
            plans = split.lookup(prompt), whole.lookup(prompt)
            assert shape_of(plans[0]) == shape_of(plans[1]) and plans[0].num_prefix_tokens == len(tokens)
            retrieved = [store.retrieve(plan) for store, plan in zip((split, whole), plans, strict=True)]
            assert torch.equal(retrieved[0].kv, kv) and torch.equal(retrieved[1].kv, kv)


def test_the_tail_is_registered_by_content_at_its_own_positions(tmp_path: Path) -> None:
    """The tail registers as one run with the resident head: its chunks keep their positions in the sequence
    (source_start), and the head's last chunk links to the tail's partial chunk, which only that link finds."""
    tokens, kv = make_tokens(2 * CHUNK + 5, seed=3), make_kv(LAYOUT, 2 * CHUNK + 5, seed=3)
    elsewhere = np.concatenate([make_tokens(3, seed=4), tokens])  # the sequence at another offset: blend only
    with disk_stores(tmp_path, enable_blend=True) as (split, whole):
        head_then_tail(split, tokens, kv, 2 * CHUNK)
        whole.store(tokens, kv)
        plans = split.lookup(elsewhere), whole.lookup(elsewhere)
        assert shape_of(plans[0]) == shape_of(plans[1])
        assert [(s.start, s.num_tokens, s.source_start, s.exact) for s in plans[0].segments] == [
            (3, CHUNK, 0, False),
            (3 + CHUNK, CHUNK, CHUNK, False),
            (3 + 2 * CHUNK, 5, 2 * CHUNK, False),
        ]
        assert torch.equal(split.retrieve(plans[0]).kv[:, :, 3:], kv)
        whole.release(plans[1])


def test_the_tail_is_deduplicated_like_a_whole_store(tmp_path: Path) -> None:
    document = make_tokens(2 * CHUNK, seed=5)
    first = np.concatenate([make_tokens(CHUNK, seed=6), document])
    second = np.concatenate([make_tokens(CHUNK, seed=7), document])
    kv_first, kv_second = make_kv(LAYOUT, 3 * CHUNK, seed=6), make_kv(LAYOUT, 3 * CHUNK, seed=7)
    with disk_stores(tmp_path, enable_blend=True, enable_dedup_content=True) as (split, whole):
        for store in (split, whole):
            store.store(first, kv_first)
        split.store(second[:CHUNK], kv_second[:, :, :CHUNK])
        tail = split.store(second, kv_second[:, :, CHUNK:], start=CHUNK)
        at_once = whole.store(second, kv_second)
        assert (tail.num_chunks, tail.num_new_chunks, tail.num_aliased_chunks) == (2, 0, 2)
        assert (at_once.num_new_chunks, at_once.num_aliased_chunks) == (1, 2)
        assert [(chunk.start, chunk.outcome) for chunk in tail.chunks] == [
            (CHUNK, ChunkOutcome.ALIASED),
            (2 * CHUNK, ChunkOutcome.ALIASED),
        ]
        assert [chunk.outcome for chunk in at_once.chunks] == [ChunkOutcome.WRITTEN] + [ChunkOutcome.ALIASED] * 2
        plans = split.lookup(second), whole.lookup(second)
        assert shape_of(plans[0]) == shape_of(plans[1])
        assert [s.exact for s in plans[0].segments] == [True, False, False]


def test_head_chunks_are_never_written(tmp_path: Path) -> None:
    tokens, kv = make_tokens(4 * CHUNK, seed=8), make_kv(LAYOUT, 4 * CHUNK, seed=8)
    keys = prefix_keys(LAYOUT.namespace, as_token_array(tokens), CHUNK)
    with TieredStore(LAYOUT, config(tmp_path, enable_segmented_prefix=True)) as store:
        result = store.store(tokens, kv[:, :, 2 * CHUNK :], start=2 * CHUNK)
        assert (result.num_chunks, result.num_new_chunks) == (2, 2)
        assert [bool(store.contains(key)) for key in keys] == [False, False, True, True]
        plan = store.lookup(tokens)
        assert [(s.start, s.exact) for s in plan.segments] == [(2 * CHUNK, True), (3 * CHUNK, True)]
        assert torch.equal(store.retrieve(plan).kv[:, :, 2 * CHUNK :], kv[:, :, 2 * CHUNK :])
        empty = store.store(tokens, kv[:, :, :0], start=4 * CHUNK)
        assert (empty.num_chunks, empty.num_new_chunks) == (0, 0)


@pytest.mark.parametrize("start", [-CHUNK, -1, 4 * CHUNK + 3, 5 * CHUNK])
def test_a_start_outside_the_tokens_is_refused(tmp_path: Path, start: int) -> None:
    tokens = make_tokens(4 * CHUNK + 2, seed=9)
    with TieredStore(LAYOUT, config(tmp_path)) as store:
        with pytest.raises(InvalidInputError, match=rf"start={start} must lie in \[0, len\(tokens\)="):
            store.store(tokens, make_kv(LAYOUT, 2), start=start)
        assert store.stats().tier(TierName.CPU).num_chunks == 0  # type: ignore[union-attr]


@pytest.mark.parametrize("start", [3, CHUNK + 1, 4 * CHUNK + 1])
def test_a_start_inside_a_chunk_writes_the_chunks_that_begin_after_it(tmp_path: Path, start: int) -> None:
    """An engine hands over KV from its own block boundary, which need not be a chunk boundary: the chunk the start
    falls in is not written (the caller says the store holds it), every later one is, bit for bit."""
    tokens, kv = make_tokens(4 * CHUNK + 2, seed=9), make_kv(LAYOUT, 4 * CHUNK + 2, seed=9)
    first_written = -(-start // CHUNK)
    with TieredStore(LAYOUT, config(tmp_path)) as store:
        result = store.store(tokens, kv[:, :, start:], start=start)
        assert result.num_chunks == result.num_new_chunks == 5 - first_written
        store.store(tokens[: first_written * CHUNK], kv[:, :, : first_written * CHUNK])
        plan = store.lookup(tokens)
        assert plan.end == len(tokens) and all(segment.exact for segment in plan.segments)
        assert torch.equal(store.retrieve(plan).kv, kv)


def test_kv_of_the_whole_sequence_with_a_start_is_refused(tmp_path: Path) -> None:
    tokens, kv = make_tokens(3 * CHUNK, seed=10), make_kv(LAYOUT, 3 * CHUNK, seed=10)
    refused = pytest.raises(InvalidInputError, match=rf"with start={CHUNK}, kv holds only tokens\[{CHUNK}:\]")
    with TieredStore(LAYOUT, config(tmp_path)) as store, refused:
        store.store(tokens, kv, start=CHUNK)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_tokens=st.integers(0, 6 * CHUNK),
    start_chunks=st.integers(0, 7),
    seed=st.integers(0, 2**16),
    head_stored=st.booleans(),
)
def test_head_then_tail_equals_a_whole_store(num_tokens: int, start_chunks: int, seed: int, head_stored: bool) -> None:
    """For any length and chunk-boundary start: the same counts for the tail, the same lookups (prefix and blend),
    the same retrieved bytes. Without the head stored first, the head stays absent and only the tail is served."""
    start = min(start_chunks * CHUNK, num_tokens - num_tokens % CHUNK)
    tokens, kv = make_tokens(num_tokens, seed=seed), make_kv(LAYOUT, num_tokens, seed=seed)
    with two_stores(memory_config(), memory_config()) as (split, whole):
        whole_head = whole.store(tokens[:start], kv[:, :, :start])
        whole_result = whole.store(tokens, kv)
        if head_stored:
            assert split.store(tokens[:start], kv[:, :, :start]) == whole_head
        tail_result = split.store(tokens, kv[:, :, start:].clone(), start=start)
        num_tail_chunks = -(-(num_tokens - start) // CHUNK)
        assert tail_result.num_chunks == num_tail_chunks
        assert tail_result.num_new_chunks == num_tail_chunks  # neither store held the tail before
        if head_stored:
            assert whole_result.num_new_chunks == num_tail_chunks
            elsewhere = np.concatenate([make_tokens(3, seed=seed + 1), tokens])
            for prompt in (tokens, elsewhere):
                plans = split.lookup(prompt), whole.lookup(prompt)
                assert shape_of(plans[0]) == shape_of(plans[1])
                served = [served_kv(store, plan) for store, plan in zip((split, whole), plans, strict=True)]
                assert all(torch.equal(a, b) for a, b in zip(*served, strict=True))
        else:
            plan = split.lookup(tokens, blend=False)
            assert plan.num_prefix_tokens == (num_tokens if start == 0 else 0)
            split.release(plan)
