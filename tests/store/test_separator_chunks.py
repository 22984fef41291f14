"""Chunk boundaries that restart after a separator: documents are found wherever a later prompt puts them.

The multi-document QA layout (system + SEP + doc + SEP + question when a document is first seen, then
system + SEP + d1 + SEP + d2 ... + SEP + question): with fixed chunks a document's first chunk also holds the system
prompt and its last one the question, so neither is ever found again, and a document shorter than a chunk never is.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import KVLayout, TieredStore
from kvstore.config import StoreConfig, parse_chunk_separator
from kvstore.errors import ConfigError
from kvstore.keys import as_token_array, chunk_bounds, prefix_keys, separator_run_starts
from kvstore.plan import LookupPlan
from tests.factories import make_kv, make_tokens, store_config

CHUNK = 16
LAYOUT = KVLayout(model_id="test/separator", num_layers=2, num_kv_heads=2, head_dim=8)
SEPARATOR = (60_001, 60_002)  # outside make_tokens' ids, like a template's delimiter


def config(tmp_path: Path, **changes: object) -> StoreConfig:
    settings: dict[str, object] = {"enable_blend": True, "chunk_separator": SEPARATOR, **changes}
    return store_config(tmp_path, LAYOUT, CHUNK, gpu_chunks=8, cpu_chunks=64, **settings)


def joined(*parts: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    return np.concatenate(parts).astype(np.int64)


SEP = np.array(SEPARATOR, dtype=np.int64)


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=80),
    chunk_size=st.integers(1, 9),
    separator=st.lists(st.integers(0, 3), min_size=0, max_size=3),
)
def test_bounds_cut_every_chunk_size_tokens_and_after_every_separator(
    tokens: list[int], chunk_size: int, separator: list[int]
) -> None:
    array = as_token_array(tokens)
    bounds = chunk_bounds(array, chunk_size, separator)
    assert bounds[0] == 0 and bounds[-1] == len(tokens)
    steps = np.diff(bounds)
    assert (steps >= 1).all() and (steps <= chunk_size).all()
    run_starts = separator_run_starts(array, separator)
    assert set(run_starts) <= set(bounds[:-1]) | {0}
    for start in run_starts[1:]:  # every run start sits right after an occurrence of the separator
        assert tokens[start - len(separator) : start] == separator
    for run_start, run_end in zip(run_starts, [*run_starts[1:], len(tokens)], strict=True):
        inside = [bound for bound in bounds if run_start <= bound < run_end]
        assert inside == list(range(run_start, run_end, chunk_size))
    if not separator:
        assert bounds == [*range(0, len(tokens), chunk_size), len(tokens)] or not tokens
    # a key names one cut: the same tokens cut another way share a key only where the cuts agree so far
    if separator:
        fixed = chunk_bounds(array, chunk_size)
        cut_of = {
            key: tuple(fixed[: index + 2]) for index, key in enumerate(prefix_keys(LAYOUT.namespace, array, chunk_size))
        }
        for index, key in enumerate(prefix_keys(LAYOUT.namespace, array, chunk_size, separator)):
            assert cut_of.get(key, tuple(bounds[: index + 2])) == tuple(bounds[: index + 2])


def test_prefix_keys_of_equal_prefixes_are_equal(tmp_path: Path) -> None:
    system, doc = make_tokens(11, seed=1), make_tokens(40, seed=2)
    first = as_token_array(joined(system, SEP, doc, SEP, make_tokens(5, seed=3)))
    second = as_token_array(joined(system, SEP, doc, SEP, make_tokens(9, seed=4)))
    shared = len(chunk_bounds(as_token_array(joined(system, SEP, doc, SEP)), CHUNK, SEPARATOR)) - 1
    first_keys = prefix_keys(LAYOUT.namespace, first, CHUNK, SEPARATOR)
    second_keys = prefix_keys(LAYOUT.namespace, second, CHUNK, SEPARATOR)
    assert first_keys[:shared] == second_keys[:shared] and first_keys[shared] != second_keys[shared]


def lookup_and_serve(store: TieredStore, tokens: npt.NDArray[np.int64]) -> tuple[LookupPlan, torch.Tensor]:
    plan = store.lookup(tokens)
    out = torch.zeros(LAYOUT.chunk_shape(len(tokens)), dtype=LAYOUT.dtype.torch_dtype)
    store.retrieve(plan, out)
    return plan, out


@pytest.mark.parametrize("chunk_separator", [SEPARATOR, ()])
def test_documents_cached_behind_a_system_prompt_are_found_in_any_order(
    tmp_path: Path, chunk_separator: tuple[int, ...]
) -> None:
    """Documents shorter than a chunk, of exactly two chunks and with a tail, cached one per prompt, then
    asked together in another order: with the separator every document token (and each document's trailing
    separator) is served from the copy cached with it, bit for bit; without it the boundary chunks are lost."""
    system = make_tokens(13, seed=10)
    documents = [make_tokens(length, seed=20 + length) for length in (5, 2 * CHUNK, 3 * CHUNK + 7)]
    question = make_tokens(6, seed=30)
    stored: dict[int, tuple[int, torch.Tensor]] = {}  # document -> (its position, its prompt's KV)
    with TieredStore(LAYOUT, config(tmp_path, chunk_separator=chunk_separator)) as store:
        for number, document in enumerate(documents):
            prompt = joined(system, SEP, document, SEP, make_tokens(4, seed=40 + number))
            kv = make_kv(LAYOUT, len(prompt), seed=50 + number)
            store.store(prompt, kv)
            stored[number] = (len(system) + len(SEP), kv)
        order = [2, 0, 1]
        query = joined(system, SEP, *(joined(documents[number], SEP) for number in order), question)
        plan, served = lookup_and_serve(store, query)
        position = len(system) + len(SEP)
        covered = np.zeros(len(query), dtype=bool)
        for segment in plan.segments:
            covered[segment.start : segment.end] = True
        for number in order:
            span = len(documents[number]) + len(SEP)
            source_start, kv = stored[number]
            if chunk_separator:
                assert covered[position : position + span].all(), f"document {number} not wholly found"
            for segment in plan.segments:
                if position <= segment.start < position + span:
                    offset = segment.source_start - source_start
                    assert offset == segment.start - position
                    expected = kv[:, :, segment.source_start : segment.source_start + segment.num_tokens]
                    assert torch.equal(served[:, :, segment.start : segment.end], expected)
            position += span
        assert covered[: len(system) + len(SEP)].all()  # the shared system prompt: an exact prefix hit
        assert plan.segments[0].exact and plan.segments[0].start == 0
        document_tokens = sum(len(document) + len(SEP) for document in documents)
        reused = int(covered[len(system) + len(SEP) : len(query) - len(question)].sum())
        if chunk_separator:
            assert reused == document_tokens
        else:
            assert reused < document_tokens - len(documents[0])  # the short document and the edges are missed


def test_documents_whose_chunks_repeat_each_other_are_found_to_their_last_token(tmp_path: Path) -> None:
    """The multi-doc QA guide's synthetic corpus: documents "<i> hi hi ...", so every chunk after a document's first
    (its partial last one included) repeats the first document's. The content index keeps one copy (dedup), whose
    next links belong to the first document, so a later document's chain stops at its first repeated chunk; its full
    chunks are still found by their windows, and its partial last chunk by its content at the run's chunk grid."""
    word = 7_777
    documents = [joined(np.array([1_000 + number]), np.full(3 * CHUNK + 4, word)) for number in range(3)]
    system, question = make_tokens(13, seed=10), make_tokens(6, seed=30)
    with TieredStore(LAYOUT, config(tmp_path)) as store:
        for number, document in enumerate(documents):
            prompt = joined(system, SEP, document, SEP, make_tokens(4, seed=40 + number))
            store.store(prompt, make_kv(LAYOUT, len(prompt), seed=50 + number))
        query = joined(system, SEP, *(joined(documents[number], SEP) for number in (2, 0, 1)), question)
        plan, _ = lookup_and_serve(store, query)
        covered = np.zeros(len(query), dtype=bool)
        for segment in plan.segments:
            covered[segment.start : segment.end] = True
        assert covered[: len(query) - len(question)].all()


def test_an_exact_prefix_hit_stays_exact_and_whole(tmp_path: Path) -> None:
    prompt = joined(make_tokens(13, seed=1), SEP, make_tokens(37, seed=2), SEP, make_tokens(5, seed=3))
    kv = make_kv(LAYOUT, len(prompt), seed=4)
    with TieredStore(LAYOUT, config(tmp_path)) as store:
        store.store(prompt, kv)
        plan, served = lookup_and_serve(store, prompt)
        assert all(segment.exact for segment in plan.segments)
        assert [segment.start for segment in plan.segments] == chunk_bounds(as_token_array(prompt), CHUNK, SEPARATOR)[
            :-1
        ]
        assert torch.equal(served, kv)


def test_a_store_from_a_block_boundary_writes_the_chunks_of_the_cut_after_it(tmp_path: Path) -> None:
    """An engine stores from its block boundary, not the cut's: the chunks beginning at or after it are written."""
    prompt = joined(make_tokens(13, seed=1), SEP, make_tokens(37, seed=2))
    bounds = chunk_bounds(as_token_array(prompt), CHUNK, SEPARATOR)
    kv = make_kv(LAYOUT, len(prompt), seed=4)
    with TieredStore(LAYOUT, config(tmp_path)) as store:
        result = store.store(prompt, kv[:, :, CHUNK:], start=CHUNK)  # 16: inside the second chunk [15, 31)
        assert bounds[1] < CHUNK < bounds[2] and result.num_chunks == len(bounds) - 3
        store.store(prompt[: bounds[2]], kv[:, :, : bounds[2]])
        plan, served = lookup_and_serve(store, prompt)
        assert plan.end == len(prompt) and all(segment.exact for segment in plan.segments)
        assert torch.equal(served, kv)


def test_documents_are_found_after_a_reopen(tmp_path: Path) -> None:
    """The content index rebuilt from the disk at open relinks chunks across a separator's short chunk."""
    system, document = make_tokens(13, seed=1), make_tokens(3 * CHUNK + 5, seed=2)
    warm = joined(system, SEP, document, SEP, make_tokens(5, seed=3))
    with TieredStore(LAYOUT, config(tmp_path)) as store:
        store.store(warm, make_kv(LAYOUT, len(warm), seed=4))
    query = joined(make_tokens(21, seed=5), SEP, document, SEP, make_tokens(5, seed=6))
    with TieredStore(LAYOUT, config(tmp_path)) as store:
        plan = store.lookup(query)
        start = 21 + len(SEP)
        covered = sum(segment.num_tokens for segment in plan.segments if start <= segment.start)
        assert covered == len(document) + len(SEP)


def test_bad_separators_are_refused_in_one_line() -> None:
    assert parse_chunk_separator("198, 198") == (198, 198)
    assert parse_chunk_separator("") == ()
    with pytest.raises(ConfigError, match="comma-separated token ids"):
        parse_chunk_separator("\\n\\n")
    with pytest.raises(ConfigError, match="not a token id"):
        StoreConfig(chunk_separator=(-1,))
    with pytest.raises(ConfigError, match="sequence of token ids"):
        StoreConfig(chunk_separator="##")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="at most 64"):
        StoreConfig(chunk_separator=tuple(range(65)))
