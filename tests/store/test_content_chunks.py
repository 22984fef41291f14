"""A store cutting chunks by content: a document cached alone is found inside any longer prompt, no separator needed.

With fixed chunks a document placed after other text shares none of its chunks with its cached copy (every chunk
straddles a different pair of its tokens). Cut by content (``StoreConfig.chunking="content"``), the prompt's chunks
agree with the copy's from the document's first content cut past ``sync_tokens`` on; the content index finds them by
their content and follows the copy's chain to its partial last chunk. Exact prefix hits, the rebuild at open and the
data dir's record of the rule are checked here too.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvstore import KVLayout, TieredStore
from kvstore.chunking import Chunking, ContentCutShape
from kvstore.config import StoreConfig
from kvstore.content.partials import MIN_PARTIAL_TOKENS
from kvstore.content_cut import content_cuts
from kvstore.errors import LayoutMismatchError
from kvstore.keys import as_token_array, chunk_bounds
from kvstore.plan import ChunkOutcome, LookupPlan
from tests.factories import make_kv, make_tokens, store_config

CHUNK = 32
LAYOUT = KVLayout(model_id="test/content-chunks", num_layers=2, num_kv_heads=2, head_dim=8)
SHAPE = ContentCutShape.for_chunk_size(CHUNK)


def config(tmp_path: Path, **changes: object) -> StoreConfig:
    settings: dict[str, object] = {"enable_blend": True, "chunking": Chunking.CONTENT, **changes}
    return store_config(tmp_path, LAYOUT, CHUNK, gpu_chunks=8, cpu_chunks=256, **settings)


def lookup_and_serve(store: TieredStore, tokens: npt.NDArray[np.int64]) -> tuple[LookupPlan, torch.Tensor]:
    plan = store.lookup(tokens)
    out = torch.zeros(LAYOUT.chunk_shape(len(tokens)), dtype=LAYOUT.dtype.torch_dtype)
    store.retrieve(plan, out)
    return plan, out


def first_synced_cut(document: npt.NDArray[np.int64]) -> int:
    """Where a document's chunks start agreeing with its copy's, wherever it sits (``kvstore.content_cut``)."""
    cuts = [cut for cut in content_cuts(as_token_array(document), SHAPE).tolist() if cut >= SHAPE.sync_tokens]
    return cuts[0] if cuts else len(document)


def covered_mask(plan: LookupPlan, num_tokens: int) -> npt.NDArray[np.bool_]:
    covered = np.zeros(num_tokens, dtype=bool)
    for segment in plan.segments:
        covered[segment.start : segment.end] = True
    return covered


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    num_before=st.integers(0, 3 * CHUNK),
    num_after=st.integers(0, CHUNK),
    document_tokens=st.integers(2 * CHUNK, 8 * CHUNK),
    seed=st.integers(0, 2**16),
)
@example(num_before=3, num_after=1, document_tokens=64, seed=1692)  # no whole chunk after the cut: nothing found
def test_a_document_stored_alone_is_found_after_any_tokens(
    tmp_path_factory: pytest.TempPathFactory, num_before: int, num_after: int, document_tokens: int, seed: int
) -> None:
    """Every chunk of the document from its first synced cut to its end (partial last chunk included) is served
    from the copy stored alone, bit for bit, at the copy's positions, once the document holds a whole chunk after
    that cut: the lookup finds that chunk by content and follows the copy's chain to its end. A document whose only
    chunk after the cut is its partial last one holds nothing the prompt shares whole (the prompt's chunk runs on
    into the tokens after it), so nothing finds it: hypothesis found such a 64-token document (seed 1692; see
    "Short documents have no anchor" in docs/design-notes.md)."""
    tmp_path = tmp_path_factory.mktemp("content")
    document = make_tokens(document_tokens, seed=seed)
    kv = make_kv(LAYOUT, document_tokens, seed=seed + 1)
    before, after = make_tokens(num_before, seed=seed + 2), make_tokens(num_after, seed=seed + 3)
    query = np.concatenate([before, document, after])
    with TieredStore(LAYOUT, config(tmp_path)) as store:
        store.store(document, kv)
        plan, served = lookup_and_serve(store, query)
    synced = first_synced_cut(document)
    bounds = chunk_bounds(as_token_array(document), CHUNK, (), Chunking.CONTENT)
    if any(synced < bound < document_tokens for bound in bounds):  # a whole chunk after the cut
        covered = covered_mask(plan, len(query))[num_before + synced : num_before + document_tokens]
        assert covered.all(), "a chunk after the re-sync point was not reused"
    for segment in plan.segments:
        assert segment.start - segment.source_start == num_before  # every hit is the document's own copy
        source = kv[:, :, segment.source_start : segment.source_start + segment.num_tokens]
        assert torch.equal(served[:, :, segment.start : segment.end], source)


def test_documents_after_a_system_prompt_are_found_in_any_order_without_a_separator(tmp_path: Path) -> None:
    """The multi-doc QA layout with no separator configured: documents cached each behind the system prompt, then
    asked together in another order. Without slices, fixed chunks find a moved document's full chunks by their
    windows, but lose its head (its first chunk held the system prompt) and its tail; content chunks find every
    token from its first synced cut to its last cut (the chunk holding its end holds other tokens too, in both
    prompts). With slices, both cuts serve the head and the tail too, from the stored chunks around those found,
    but for stretches shorter than ``MIN_PARTIAL_TOKENS``."""
    system, question = make_tokens(13, seed=10), make_tokens(6, seed=30)
    documents = [make_tokens(length, seed=20 + length) for length in (5 * CHUNK + 7, 4 * CHUNK, 6 * CHUNK + 3)]
    reused: dict[tuple[Chunking, bool], int] = {}
    for chunking in Chunking:
        with TieredStore(LAYOUT, config(tmp_path / chunking.value, chunking=chunking)) as store:
            for number, document in enumerate(documents):
                prompt = np.concatenate([system, document, make_tokens(4, seed=40 + number)])
                store.store(prompt, make_kv(LAYOUT, len(prompt), seed=50 + number))
            order = [2, 0, 1]
            query = np.concatenate([system, *(documents[number] for number in order), question])
            for partial in (False, True):
                plan = store.lookup(query, partial=partial)
                covered = covered_mask(plan, len(query))
                moved_span = covered[len(system) + len(documents[2]) : len(query) - len(question)]
                reused[chunking, partial] = int(moved_span.sum())
                if chunking is Chunking.CONTENT:
                    position = len(system)
                    for number in order:
                        document = documents[number]
                        last_cut = chunk_bounds(as_token_array(document), CHUNK, (), chunking)[-2]
                        assert covered[position + first_synced_cut(document) : position + last_cut].all()
                        position += len(documents[number])
                store.release(plan)
    moved = len(documents[0]) + len(documents[1])
    assert reused[Chunking.FIXED, False] < reused[Chunking.CONTENT, False], reused
    assert reused[Chunking.CONTENT, False] >= moved - 2 * (SHAPE.sync_tokens + 2 * CHUNK), reused
    for chunking in Chunking:  # at most a short stretch at each end of each moved document is computed
        assert reused[chunking, True] >= max(reused[chunking, False], moved - 4 * (MIN_PARTIAL_TOKENS - 1)), reused


def test_an_exact_prefix_hit_stays_exact(tmp_path: Path) -> None:
    """A stored prompt is served whole and exact; a longer prompt starting with it gets every chunk of it as exact
    segments, as with fixed chunks: those the longer prompt's cut shares by the prefix leg (a prefix's cut is the
    longer prompt's), its partial last one by its content and its key (the match leg proves it exact)."""
    prompt = make_tokens(7 * CHUNK + 5, seed=1)
    longer = np.concatenate([prompt, make_tokens(3 * CHUNK, seed=2)])
    kv = make_kv(LAYOUT, len(longer), seed=3)
    with TieredStore(LAYOUT, config(tmp_path)) as store:
        store.store(prompt, kv[:, :, : len(prompt)])
        plan, served = lookup_and_serve(store, prompt)
        assert all(segment.exact for segment in plan.segments) and plan.end == len(prompt)
        assert [segment.start for segment in plan.segments] == store.chunk_bounds(as_token_array(prompt))[:-1]
        assert torch.equal(served, kv[:, :, : len(prompt)])
        plan, served = lookup_and_serve(store, longer)
        stored_bounds = store.chunk_bounds(as_token_array(prompt))
        assert store.chunk_bounds(as_token_array(longer))[: len(stored_bounds) - 1] == stored_bounds[:-1]
        exact = [segment for segment in plan.segments if segment.exact]
        assert [segment.start for segment in exact] == stored_bounds[:-1] and exact[-1].end == len(prompt)
        assert torch.equal(served[:, :, : len(prompt)], kv[:, :, : len(prompt)])


def test_the_store_cuts_with_the_one_function(tmp_path: Path) -> None:
    tokens = as_token_array(make_tokens(20 * CHUNK, seed=4))
    with TieredStore(LAYOUT, config(tmp_path)) as store:
        result = store.store(tokens, make_kv(LAYOUT, len(tokens), seed=5))
        bounds = chunk_bounds(tokens, CHUNK, (), Chunking.CONTENT)
        assert store.chunk_bounds(tokens) == bounds
        assert [(chunk.start, chunk.end) for chunk in result.chunks] == list(itertools.pairwise(bounds))
        assert bounds != chunk_bounds(tokens, CHUNK)


def test_documents_are_found_after_a_reopen_and_the_rule_is_recorded(tmp_path: Path) -> None:
    """The content index rebuilt from the disk at open finds a document's chunks in a new prompt; the data dir
    records its rule, and an open with the other one is refused in one line (its chunks were cut the other way)."""
    document = make_tokens(9 * CHUNK + 5, seed=2)
    kv = make_kv(LAYOUT, len(document), seed=4)
    with TieredStore(LAYOUT, config(tmp_path)) as store:
        store.store(document, kv)
    query = np.concatenate([make_tokens(21, seed=5), document, make_tokens(5, seed=6)])
    with TieredStore(LAYOUT, config(tmp_path, gpu_capacity_bytes=0, tiers=("cpu", "disk"))) as store:
        plan, served = lookup_and_serve(store, query)
    synced = 21 + first_synced_cut(document)
    assert covered_mask(plan, len(query))[synced : 21 + len(document)].all()
    for segment in plan.segments:
        source = kv[:, :, segment.source_start : segment.source_start + segment.num_tokens]
        assert torch.equal(served[:, :, segment.start : segment.end], source)
    with pytest.raises(LayoutMismatchError, match="cut by --chunking content, but it was opened with --chunking fixed"):
        TieredStore(LAYOUT, config(tmp_path, chunking=Chunking.FIXED))
    with TieredStore(LAYOUT, config(tmp_path / "fixed", chunking=Chunking.FIXED)):
        pass
    with pytest.raises(LayoutMismatchError, match="pass --chunking fixed"):
        TieredStore(LAYOUT, config(tmp_path / "fixed"))


def test_a_document_stored_after_other_text_again_is_stored_once_with_dedup(tmp_path: Path) -> None:
    """Dedup-content follows the cut: the same document behind two different prefixes has the same chunks from its
    first synced cut on, so the second store records them as aliases of the first copy instead of payloads."""
    document = make_tokens(10 * CHUNK + 3, seed=71)
    first = np.concatenate([make_tokens(9, seed=72), document])
    second = np.concatenate([make_tokens(40, seed=73), document])
    with TieredStore(LAYOUT, config(tmp_path, enable_dedup_content=True)) as store:
        store.store(first, make_kv(LAYOUT, len(first), seed=74))
        result = store.store(second, make_kv(LAYOUT, len(second), seed=75))
        synced = 40 + first_synced_cut(document)
        aliased = [chunk for chunk in result.chunks if chunk.outcome is ChunkOutcome.ALIASED]
        assert aliased and aliased[0].start == synced
        assert sum(chunk.end - chunk.start for chunk in aliased) == len(second) - synced
        plan = store.lookup(second)
        assert covered_mask(plan, len(second)).all()
