"""Slices: a document stored in other surroundings (a template before it, a question after it) is served in a query
where other text surrounds it, down to its first and last tokens, each from the rows of the stored chunk that hold
it; a prompt that leaves a stored one mid-chunk keeps the common rows as an exact prefix.

Real tiers (gpu logic on host memory, cpu, disk), real KV: every served token must be the stored copy's own row,
from memory views and from chunks decoded whole on disk alike, also from ``retrieve(start=...)`` and by ``part``.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import KVLayout, TieredStore
from kvstore.chunking import Chunking
from kvstore.content.partials import MIN_PARTIAL_TOKENS
from kvstore.kv_part import KVPart
from kvstore.plan import LookupPlan, Segment
from kvstore.tiers.base import TierName
from tests.factories import make_kv, make_tokens, store_config

CHUNK = 128  # content chunks of 32-128 tokens: a document's head before its first shared cut is often >= 16
LAYOUT = KVLayout(model_id="test/partial-segments", num_layers=4, num_kv_heads=2, head_dim=8)
UNWRITTEN = 7.0


_STORES = [(Chunking.CONTENT, "memory"), (Chunking.CONTENT, "disk"), (Chunking.FIXED, "memory")]


@contextlib.contextmanager
def opened_store(tmp_path: Path, chunking: Chunking, where: str) -> Iterator[TieredStore]:
    """A blending store whose chunks are read from the memory tiers, or only from the disk (decoded whole)."""
    tiers = (TierName.GPU, TierName.CPU, TierName.DISK) if where == "memory" else (TierName.DISK,)
    config = store_config(
        tmp_path, LAYOUT, CHUNK, gpu_chunks=4, cpu_chunks=64, tiers=tiers, enable_blend=True, chunking=chunking
    )
    with TieredStore(LAYOUT, config) as opened:
        yield opened


@pytest.fixture(params=_STORES, ids=["content-memory", "content-disk", "fixed-memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TieredStore]:
    with opened_store(tmp_path, *request.param) as opened:
        yield opened


def served_rows(segments: tuple[Segment, ...], kv: torch.Tensor, out: torch.Tensor, start: int = 0) -> None:
    """Every loaded segment's tokens in ``out`` (token ``start + i`` at index ``i``) are the stored rows its source
    positions name, and nothing else was written."""
    written = torch.zeros(out.shape[2], dtype=torch.bool)
    for segment in segments:
        first = max(segment.start, start)
        source = segment.source_start + first - segment.start
        expected = kv[:, :, source : source + segment.end - first]
        assert torch.equal(out[:, :, first - start : segment.end - start], expected), segment
        written[first - start : segment.end - start] = True
    assert bool((out[:, :, ~written] == UNWRITTEN).all()), "a token no segment names was written"


def covered(plan: LookupPlan) -> npt.NDArray[np.bool_]:
    mask = np.zeros(plan.num_query_tokens, dtype=bool)
    for segment in plan.segments:
        mask[segment.start : segment.end] = True
    return mask


@pytest.mark.parametrize("kind", _STORES, ids=["content-memory", "content-disk", "fixed-memory"])
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    before=st.integers(0, 300),
    after=st.integers(1, 200),
    document_tokens=st.integers(3 * CHUNK, 6 * CHUNK),
    start=st.integers(0, 400),
    seed=st.integers(0, 2**16),
)
def test_a_document_stored_behind_other_text_is_served_to_its_ends_from_its_stored_rows(
    tmp_path_factory: pytest.TempPathFactory,
    kind: tuple[Chunking, str],
    before: int,
    after: int,
    document_tokens: int,
    start: int,
    seed: int,
) -> None:
    """Stored behind a template and before a question; asked behind other text and before other text: the whole
    document is served but for fewer than ``MIN_PARTIAL_TOKENS`` at either end (its head and tail as slices of the
    stored chunks around the ones the query's cut shares; a stored chunk holding fewer of its tokens than that is
    not sliced), and each served token is its stored row, re-rotatable by the segment's delta, from any ``start``."""
    template, question = make_tokens(21, seed=seed), make_tokens(40, seed=seed + 1)
    document = make_tokens(document_tokens, seed=seed + 2)
    stored = np.concatenate([template, document, question])
    kv = make_kv(LAYOUT, len(stored), seed=seed + 3)
    query = np.concatenate([make_tokens(before, seed=seed + 4), document, make_tokens(after, seed=seed + 5)])
    with opened_store(tmp_path_factory.mktemp("slices"), *kind) as store:
        store.store(stored, kv)
        store.flush()
        plan = store.lookup(query)
        start = min(start, plan.end)
        out = torch.full(LAYOUT.chunk_shape(plan.end - start), UNWRITTEN, dtype=LAYOUT.dtype.torch_dtype)
        result = store.retrieve(plan, out, start=start)
    served = np.flatnonzero(covered(plan))
    assert served.shape[0] == served[-1] + 1 - served[0], "the document is served in one run"
    assert served[0] - before < MIN_PARTIAL_TOKENS and before + document_tokens - served[-1] <= MIN_PARTIAL_TOKENS
    assert served[-1] < before + document_tokens, "nothing past the document"
    for segment in plan.segments:
        assert not segment.exact and segment.rope_delta == before - len(template)
        assert segment.offset + segment.num_tokens <= segment.stored_tokens
    assert [segment for segment in plan.segments if segment.end > start] == list(result.segments)
    served_rows(result.segments, kv, out, start)


def test_a_slice_by_part_is_the_part_of_its_rows(store: TieredStore) -> None:
    """A tensor-parallel rank's retrieve: the part's layers and heads of exactly the slice's rows."""
    template, question = make_tokens(30, seed=1), make_tokens(50, seed=2)
    document = make_tokens(5 * CHUNK, seed=3)
    stored = np.concatenate([template, document, question])
    kv = make_kv(LAYOUT, len(stored), seed=4)
    store.store(stored, kv)
    store.flush()
    query = np.concatenate([make_tokens(70, seed=5), document, make_tokens(60, seed=6)])
    plan = store.lookup(query)
    assert any(segment.is_slice for segment in plan.segments)
    part = KVPart(layer_start=1, layer_end=3, head_start=1, head_end=2)
    result = store.retrieve(plan, part=part)
    for segment in result.segments:
        source = kv[:, :, segment.source_start : segment.source_start + segment.num_tokens]
        assert torch.equal(result.kv[:, :, segment.start : segment.end], part.of(source)), segment


def stored_chunk_after(store: TieredStore, tokens: npt.NDArray[np.int64], position: int, longer_than: int) -> int:
    """The start of the first chunk the store cuts ``tokens`` into at or after ``position`` that holds more than
    ``longer_than`` tokens."""
    bounds = store.chunk_bounds(tokens)
    return next(b for b, e in itertools.pairwise(bounds) if b >= position and e - b > longer_than)


def test_a_prompt_leaving_a_stored_one_mid_chunk_keeps_the_common_rows_exact(store: TieredStore) -> None:
    """A query that shares a stored prompt up to 40 tokens into one of its chunks, then goes on otherwise (the
    same system prompt and the first words of another question): that chunk's first 40 rows were computed after the
    same tokens at the same positions, so they are an exact slice and the exact prefix runs to the first token that
    differs."""
    stored = make_tokens(1000, seed=7)
    kv = make_kv(LAYOUT, len(stored), seed=8)
    store.store(stored, kv)
    store.flush()
    split = stored_chunk_after(store, stored, 500, 40) + 40
    query = np.concatenate([stored[:split], make_tokens(100, seed=9)])
    plan = store.lookup(query)
    assert plan.num_prefix_tokens == split
    assert all(segment.exact for segment in plan.segments)
    last = plan.segments[-1]
    assert last.is_slice and last.offset == 0 and last.num_tokens == 40 and last.source_start == last.start
    out = torch.full(LAYOUT.chunk_shape(plan.end), UNWRITTEN, dtype=LAYOUT.dtype.torch_dtype)
    served_rows(store.retrieve(plan, out).segments, kv, out)
    without = store.lookup(query, partial=False)
    assert not any(segment.is_slice for segment in without.segments) and without.num_prefix_tokens == split - 40
    store.release(without)


def test_a_stretch_below_the_minimum_is_computed(store: TieredStore) -> None:
    """A query that shares fewer than ``MIN_PARTIAL_TOKENS`` of a stored chunk's rows past the last whole chunk
    gets no slice there: those tokens are computed."""
    stored = make_tokens(1000, seed=11)
    store.store(stored, make_kv(LAYOUT, len(stored), seed=12))
    store.flush()
    whole_end = stored_chunk_after(store, stored, 500, MIN_PARTIAL_TOKENS)
    query = np.concatenate([stored[: whole_end + MIN_PARTIAL_TOKENS - 1], make_tokens(100, seed=13)])
    plan = store.lookup(query)
    assert plan.num_prefix_tokens == whole_end
    assert not any(segment.is_slice for segment in plan.segments)
    store.release(plan)
