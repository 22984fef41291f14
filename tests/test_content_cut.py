"""Content-defined chunk boundaries: the same document is cut the same way wherever it sits in a prompt.

Property tests of ``kvstore.content_cut`` through ``kvstore.keys.chunk_bounds`` (the one function the store cuts
with): deterministic, every chunk within ``chunk_size``, chunks between content cuts at least ``min_tokens``, the
boundaries of a prefix are the sequence's, a document after any other tokens shares every boundary from its first
content cut past ``sync_tokens`` on, and a separator still cuts.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.chunking import Chunking, ContentCutShape, parse_chunking
from kvstore.config import StoreConfig
from kvstore.content_cut import content_bounds, content_cuts
from kvstore.errors import ConfigError
from kvstore.keys import TokenArray, as_token_array, chunk_bounds, prefix_keys, separator_run_starts
from kvstore.layout import KVLayout

LAYOUT = KVLayout(model_id="test/content-cut", num_layers=2, num_kv_heads=2, head_dim=8)
CONTENT = Chunking.CONTENT


def token_arrays(max_size: int) -> st.SearchStrategy[TokenArray]:
    """Token ids from tiny alphabets (repetitive text: runs, periods) to a real vocabulary, short or long."""
    listed = st.integers(1, 50_000).flatmap(
        lambda vocab: st.lists(st.integers(0, vocab - 1), max_size=max_size).map(as_token_array)
    )
    seeded = st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 4 * max_size), st.sampled_from([2, 7, 50_000])).map(
        lambda drawn: as_token_array(np.random.default_rng(drawn[0]).integers(0, drawn[2], drawn[1]))
    )
    return st.one_of(listed, seeded)


CHUNK_SIZES = st.sampled_from([16, 17, 24, 64, 256])


def content(tokens: TokenArray, chunk_size: int, separator: tuple[int, ...] = ()) -> list[int]:
    return chunk_bounds(tokens, chunk_size, separator, CONTENT)


@settings(max_examples=300, deadline=None)
@given(tokens=token_arrays(600), chunk_size=CHUNK_SIZES)
def test_chunks_hold_at_most_chunk_size_and_at_least_the_minimum_between_content_cuts(
    tokens: TokenArray, chunk_size: int
) -> None:
    shape = ContentCutShape.for_chunk_size(chunk_size)
    bounds = content(tokens, chunk_size)
    assert bounds[0] == 0 and bounds[-1] == len(tokens)
    lengths = np.diff(bounds)
    assert ((lengths >= 1) & (lengths <= chunk_size)).all()
    cuts = set(content_cuts(tokens, shape).tolist())
    assert cuts <= set(bounds)
    for index, length in enumerate(lengths.tolist()):
        if length < shape.min_tokens:  # only a sequence's last chunk, or one right after a forced cut
            assert index == len(lengths) - 1 or (index > 0 and lengths[index - 1] == chunk_size)
    for start, end in itertools.pairwise(bounds):
        if end not in cuts and end != len(tokens):  # a forced cut: chunk_size tokens passed without a content cut
            assert end - start == chunk_size


@settings(max_examples=200, deadline=None)
@given(tokens=token_arrays(400), chunk_size=CHUNK_SIZES)
def test_the_cut_is_deterministic_and_depends_on_token_values_only(tokens: TokenArray, chunk_size: int) -> None:
    bounds = content(tokens, chunk_size)
    assert content(tokens.copy(), chunk_size) == bounds
    assert chunk_bounds(as_token_array(tokens.astype(np.int64)), chunk_size, (), CONTENT) == bounds
    assert content_bounds(tokens, ContentCutShape.for_chunk_size(chunk_size)) == bounds


@settings(max_examples=200, deadline=None)
@given(tokens=token_arrays(500), chunk_size=CHUNK_SIZES, cut_at=st.floats(0, 1))
def test_a_prefix_is_cut_as_the_whole_sequence_is(tokens: TokenArray, chunk_size: int, cut_at: float) -> None:
    """Exact prefix hits stay exact: a stored prefix's chunks are the longer prompt's, keys included."""
    length = int(cut_at * len(tokens))
    whole = content(tokens, chunk_size)
    assert content(tokens[:length], chunk_size) == ([*(bound for bound in whole if bound < length), length])
    num_whole_chunks = sum(1 for bound in whole[1:] if bound <= length)
    assert (
        prefix_keys(LAYOUT.namespace, tokens[:length], chunk_size, (), CONTENT)[:num_whole_chunks]
        == prefix_keys(LAYOUT.namespace, tokens, chunk_size, (), CONTENT)[:num_whole_chunks]
    )


def shared_from_first_synced_cut(prefix: TokenArray, document: TokenArray, chunk_size: int) -> int | None:
    """Check that ``document`` after ``prefix`` has every content cut the document alone has from ``sync_tokens`` on,
    and every boundary from the first of them; return that cut (``None``: the document has none)."""
    shape = ContentCutShape.for_chunk_size(chunk_size)
    offset = len(prefix)
    inside = [bound - offset for bound in content(np.concatenate([prefix, document]), chunk_size) if bound >= offset]
    alone = content(document, chunk_size)
    synced = [cut for cut in content_cuts(document, shape).tolist() if cut >= shape.sync_tokens]
    assert set(synced) <= set(inside)
    if not synced:
        return None
    first = synced[0]
    assert [bound for bound in inside if bound >= first] == [bound for bound in alone if bound >= first]
    return first


@settings(max_examples=300, deadline=None)
@given(prefix=token_arrays(300), document=token_arrays(600), chunk_size=CHUNK_SIZES)
def test_a_document_after_any_prefix_shares_every_boundary_after_it_resynchronises(
    prefix: TokenArray, document: TokenArray, chunk_size: int
) -> None:
    shared_from_first_synced_cut(prefix, document, chunk_size)


@pytest.mark.parametrize("chunk_size", [64, 256])
def test_documents_resynchronise_within_about_one_chunk_of_their_start(chunk_size: int) -> None:
    """On real-vocabulary text the first shared boundary lies about half a chunk past ``sync_tokens`` (measured:
    chunk 64, ~26 tokens in; chunk 256, ~90-175): what a document loses when placed after other text."""
    rng = np.random.default_rng(7)
    firsts = []
    for _ in range(100):
        document = as_token_array(rng.integers(0, 50_000, 2_000))
        prefix = as_token_array(rng.integers(0, 50_000, int(rng.integers(0, 700))))
        first = shared_from_first_synced_cut(prefix, document, chunk_size)
        assert first is not None
        firsts.append(first)
    assert float(np.mean(firsts)) < chunk_size
    assert max(firsts) < 3 * chunk_size


@settings(max_examples=200, deadline=None)
@given(
    tokens=token_arrays(500),
    chunk_size=CHUNK_SIZES,
    separator=st.lists(st.integers(0, 6), min_size=1, max_size=3).map(tuple),
)
def test_a_separator_still_cuts_and_each_run_is_cut_on_its_own(
    tokens: TokenArray, chunk_size: int, separator: tuple[int, ...]
) -> None:
    bounds = content(tokens, chunk_size, separator)
    run_starts = separator_run_starts(tokens, separator)
    assert set(run_starts) <= set(bounds)
    shape = ContentCutShape.for_chunk_size(chunk_size)
    for run_start, run_end in zip(run_starts, [*run_starts[1:], len(tokens)], strict=True):
        inside = [bound - run_start for bound in bounds if run_start <= bound <= run_end]
        assert inside == content_bounds(tokens[run_start:run_end], shape) or not len(tokens)


def test_the_fixed_rule_is_unchanged() -> None:
    tokens = as_token_array(np.arange(1000) % 97)
    assert chunk_bounds(tokens, 256) == chunk_bounds(tokens, 256, (), Chunking.FIXED) == [0, 256, 512, 768, 1000]


def test_content_chunking_needs_a_chunk_of_16_tokens_and_a_known_name() -> None:
    with pytest.raises(ConfigError, match="chunk_size >= 16"):
        StoreConfig(chunk_size=8, chunking=Chunking.CONTENT)
    with pytest.raises(ConfigError, match="chunk_size >= 16"):
        chunk_bounds(as_token_array([1, 2, 3]), 8, (), CONTENT)
    with pytest.raises(ConfigError, match="must be one of fixed, content"):
        StoreConfig(chunking="rolling")  # type: ignore[arg-type]
    assert StoreConfig(chunking="content").chunking is Chunking.CONTENT  # type: ignore[arg-type]
    assert parse_chunking("fixed") is Chunking.FIXED


def test_shape_for_the_default_chunk() -> None:
    shape = ContentCutShape.for_chunk_size(256)
    assert (shape.max_tokens, shape.min_tokens, shape.window_tokens, shape.divisor) == (256, 64, 16, 64)
    assert shape.sync_tokens == 79
