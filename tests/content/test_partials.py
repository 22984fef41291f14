"""Partial matches: a document stored in other surroundings is found in a query up to exactly the stretch the two
share, token for token, at its head (the stored predecessor's common suffix) and its tail (the stored successor's
common prefix); never a token more, never one that differs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.content import FingerprintIndex
from kvstore.content.index import Anchor, PartialMatch
from kvstore.content.partials import common_prefix_length, common_suffix_length
from kvstore.errors import ConfigError
from kvstore.keys import PrefixKey, TokenArray, num_chunks
from tests.content.test_index import random_keys, random_tokens

PROPERTY_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VOCAB = 2**32 - 1  # no accidental repeats between independent random parts


def altered(rng: np.random.Generator, tokens: TokenArray) -> TokenArray:
    """Other tokens in every position (a document's first or last tokens merged otherwise with their neighbours)."""
    fresh = random_tokens(rng, tokens.shape[0], vocab=VOCAB)
    return np.where(fresh == tokens, fresh + 1, fresh).astype(np.uint32)


class StoredSequence:
    """One registered sequence cut every ``chunk_size`` tokens: its chunks' tokens by key, as a tier holds them."""

    def __init__(self, index: FingerprintIndex, tokens: TokenArray, chunk_size: int, rng: np.random.Generator) -> None:
        self.tokens = tokens
        self.chunk_size = chunk_size
        self.keys = random_keys(rng, num_chunks(tokens.shape[0], chunk_size))
        index.register(tokens, self.keys, chunk_size)
        self.chunks = {
            key: tokens[number * chunk_size : (number + 1) * chunk_size] for number, key in enumerate(self.keys)
        }

    def read(self, key: PrefixKey) -> TokenArray | None:
        return self.chunks.get(key)

    def kept_stretch(self, common: int, boundary: int, forward: bool, min_tokens: int) -> int:
        """Of ``common`` shared tokens from source position ``boundary`` (a chunk boundary) on (or back), how many
        the rules keep: every chunk held whole, then the rest of one more chunk if it is ``min_tokens`` or more."""
        size, length = self.chunk_size, self.tokens.shape[0]
        kept = 0
        while kept < common:
            # every chunk before a boundary is whole-sized; after it, the sequence's last one may be shorter
            chunk_tokens = min(size, length - (boundary + kept)) if forward else size
            piece = min(chunk_tokens, common - kept)
            if piece < chunk_tokens:
                return kept + (piece if piece >= min_tokens else 0)
            kept += piece
        return kept


def shared_run(left: TokenArray, right: TokenArray, *, forward: bool) -> int:
    """Brute force: how many tokens the two share from their starts (``forward``) or from their ends."""
    count = 0
    limit = min(left.shape[0], right.shape[0])
    while count < limit:
        index = count if forward else -1 - count
        if left[index] != right[index]:
            break
        count += 1
    return count


def assert_rows_of_their_chunks(found: list[PartialMatch], query: TokenArray, sequence: StoredSequence) -> None:
    """Each stretch holds, token for token, the rows ``[offset, offset + n)`` of its stored chunk, at the source
    position its chunk and offset say."""
    for partial in found:
        chunk = sequence.chunks[partial.key]
        assert partial.chunk_tokens == chunk.shape[0]
        np.testing.assert_array_equal(
            query[partial.query_start : partial.end], chunk[partial.offset : partial.offset + partial.num_tokens]
        )
        chunk_start = sequence.keys.index(partial.key) * sequence.chunk_size
        assert partial.source_start == chunk_start + partial.offset


def covered_run(found: list[PartialMatch], start: int, *, forward: bool) -> int:
    """The contiguous run the stretches cover from ``start`` on (``forward``) or back from it."""
    ranges = {(partial.query_start, partial.end) for partial in found}
    length = 0
    while True:
        step = next(
            (end - begin for begin, end in ranges if (begin == start + length if forward else end == start - length)),
            0,
        )
        if not step:
            return length
        length += step


@PROPERTY_SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    chunk_size=st.integers(4, 24),
    min_tokens=st.integers(1, 24),
    lengths=st.tuples(st.integers(0, 60), st.integers(0, 60), st.integers(0, 60), st.integers(0, 60)),
    document_chunks=st.integers(3, 8),
    data=st.data(),
)
def test_a_document_after_any_text_with_its_ends_altered_is_found_with_exactly_the_common_stretch(
    seed: int,
    chunk_size: int,
    min_tokens: int,
    lengths: tuple[int, int, int, int],
    document_chunks: int,
    data: st.DataObject,
) -> None:
    """Stored: text, the document, text. Queried: other text, the document with its first and last few tokens
    altered, other text. Around the first and last whole chunks the match finds, the stretches reach back and
    forward exactly as far as the stored sequence and the query agree (whole chunks, then a partial one of at least
    ``min_tokens``), and every token they cover is the stored chunk's own."""
    rng = np.random.default_rng(seed)
    stored_before, stored_after, query_before, query_after = (random_tokens(rng, n, vocab=VOCAB) for n in lengths)
    document = random_tokens(rng, document_chunks * chunk_size + data.draw(st.integers(0, chunk_size)), vocab=VOCAB)
    head_altered = data.draw(st.integers(0, chunk_size))
    tail_altered = data.draw(st.integers(0, chunk_size))
    changed = document.copy()
    changed[:head_altered] = altered(rng, document[:head_altered])
    changed[changed.shape[0] - tail_altered :] = altered(rng, document[document.shape[0] - tail_altered :])
    index = FingerprintIndex(initial_capacity=4)
    sequence = StoredSequence(index, np.concatenate([stored_before, document, stored_after]), chunk_size, rng)
    query = np.concatenate([query_before, changed, query_after])
    matches = index.match(query, chunk_size)
    if not matches:
        return  # the alterations left no whole chunk: nothing to anchor on
    anchors = [Anchor(found.query_start, found.num_tokens, found.key) for found in matches]
    found = index.partial_matches(query, anchors, sequence.read, min_tokens=min_tokens)

    assert_rows_of_their_chunks(found, query, sequence)
    taken = sorted([(a.query_start, a.end) for a in anchors] + [(p.query_start, p.end) for p in found])
    assert all(end <= begin for (_, end), (begin, _) in itertools.pairwise(taken)), "overlap"
    first, last = matches[0], matches[-1]
    delta = first.query_start - first.source_start  # every match is the document's own copy, moved by this
    assert all(match.query_start - match.source_start == delta for match in matches)
    head_common = shared_run(sequence.tokens[: first.source_start], query[: first.query_start], forward=False)
    assert covered_run(found, first.query_start, forward=False) == sequence.kept_stretch(
        head_common, first.source_start, False, min_tokens
    )
    last_end = last.source_start + last.num_tokens
    tail_common = shared_run(sequence.tokens[last_end:], query[last.query_start + last.num_tokens :], forward=True)
    assert covered_run(found, last.query_start + last.num_tokens, forward=True) == sequence.kept_stretch(
        tail_common, last_end, True, min_tokens
    )


def test_a_stretch_shorter_than_the_minimum_is_left_to_compute() -> None:
    rng = np.random.default_rng(1)
    chunk_size = 16
    index = FingerprintIndex()
    document = random_tokens(rng, 4 * chunk_size, vocab=VOCAB)
    sequence = StoredSequence(index, np.concatenate([random_tokens(rng, 5, vocab=VOCAB), document]), chunk_size, rng)
    query = np.concatenate([random_tokens(rng, 9, vocab=VOCAB), document])
    anchors = [Anchor(m.query_start, m.num_tokens, m.key) for m in index.match(query, chunk_size)]
    head = anchors[0].query_start - 9  # the document's tokens before the first whole chunk: 11
    assert head == 11
    assert [p.num_tokens for p in index.partial_matches(query, anchors, sequence.read, min_tokens=11)] == [11]
    assert index.partial_matches(query, anchors, sequence.read, min_tokens=12) == []


def test_a_chunk_whose_tokens_are_not_at_hand_is_not_sliced() -> None:
    """The index keeps no tokens: a chunk its caller cannot read (no local tier holds it), or one whose tokens are
    not as long as its entry, gives no stretch."""
    rng = np.random.default_rng(2)
    index = FingerprintIndex()
    document = random_tokens(rng, 64, vocab=VOCAB)
    sequence = StoredSequence(index, np.concatenate([document, random_tokens(rng, 20, vocab=VOCAB)]), 16, rng)
    query = np.concatenate([document, random_tokens(rng, 20, vocab=VOCAB)])
    query[-20:-10] = sequence.tokens[-20:-10]  # the stored last chunk's first 10 tokens, then others
    anchors = [Anchor(m.query_start, m.num_tokens, m.key) for m in index.match(query, 16)]
    assert [p.num_tokens for p in index.partial_matches(query, anchors, sequence.read, min_tokens=4)] == [10]
    assert index.partial_matches(query, anchors, lambda key: None, min_tokens=4) == []
    assert index.partial_matches(query, anchors, lambda key: sequence.tokens[:3], min_tokens=4) == []
    with pytest.raises(ConfigError, match="min_tokens"):
        index.partial_matches(query, anchors, sequence.read, min_tokens=0)


def test_neighbours_follow_the_first_sequence_and_forget_removed_chunks() -> None:
    rng = np.random.default_rng(3)
    index = FingerprintIndex()
    tokens = random_tokens(rng, 40, vocab=VOCAB)  # chunks of 16, 16, 8
    keys = random_keys(rng, 3)
    index.register(tokens, keys, 16, source_start=100)
    before, after = index.neighbours(keys[1:2])[0]
    assert before is not None and after is not None
    assert (before.key, before.source_start, before.num_tokens) == (keys[0], 100, 16)
    assert (after.key, after.source_start, after.num_tokens) == (keys[2], 132, 8)
    assert index.neighbours([keys[0]])[0][0] is None and index.neighbours([keys[2]])[0][1] is None
    assert index.neighbours([PrefixKey(b"x" * 16), PrefixKey(b"short")]) == [(None, None), (None, None)]
    index.remove([keys[0], keys[2]])
    assert index.neighbours([keys[1]]) == [(None, None)]


def test_anchors_without_neighbours_and_an_empty_query() -> None:
    index = FingerprintIndex()
    query = np.arange(10, dtype=np.uint32)
    assert index.partial_matches(query, [], lambda key: None) == []
    anchor = Anchor(0, 10, PrefixKey(b"k" * 16))
    assert index.partial_matches(query, [anchor], lambda key: None) == []


def test_common_runs() -> None:
    left = np.array([1, 2, 3, 4], dtype=np.uint32)
    assert common_prefix_length(left, np.array([1, 2, 9], dtype=np.uint32)) == 2
    assert common_prefix_length(left, left[:2]) == 2
    assert common_suffix_length(left, np.array([7, 3, 4], dtype=np.uint32)) == 2
    assert common_suffix_length(left, np.array([], dtype=np.uint32)) == 0
