"""FingerprintIndex: finds every live chunk at any offset, never a removed one, never a false positive."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.content import Alias, FingerprintIndex, Match
from kvstore.content.index import ChunkContents
from kvstore.content.rolling_hash import block_fingerprints, rolling_fingerprints
from kvstore.errors import ConfigError, InvalidInputError
from kvstore.keys import PrefixKey, TokenArray, num_chunks

VOCAB = 50_000
PROPERTY_SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def random_tokens(rng: np.random.Generator, num_tokens: int, vocab: int = VOCAB) -> TokenArray:
    return rng.integers(0, vocab, size=num_tokens).astype(np.uint32)


def random_keys(rng: np.random.Generator, count: int) -> list[PrefixKey]:
    return [PrefixKey(rng.bytes(16)) for _ in range(count)]


def assert_verified(index_matches: list[Match], query: TokenArray, stored: dict[PrefixKey, TokenArray]) -> None:
    """Each match's query tokens equal the stored chunk's tokens; matches are sorted and disjoint."""
    previous_end = 0
    for match in index_matches:
        assert match.query_start >= previous_end
        previous_end = match.query_start + match.num_tokens
        expected = stored[match.key]
        np.testing.assert_array_equal(query[match.query_start : previous_end], expected)


def chunk_map(tokens: TokenArray, keys: list[PrefixKey], chunk_size: int) -> dict[PrefixKey, TokenArray]:
    return {key: tokens[i * chunk_size : (i + 1) * chunk_size] for i, key in enumerate(keys)}


def test_rolling_and_block_fingerprints_agree() -> None:
    tokens = random_tokens(np.random.default_rng(1), 1000, vocab=2**32 - 1)
    rolling = rolling_fingerprints(tokens, 13)
    for start in (0, 1, 7, 500, 987):
        assert rolling[start] == block_fingerprints(tokens[start : start + 13], 13)[0]
    assert len(block_fingerprints(tokens, 13)) == num_chunks(1000, 13)


@PROPERTY_SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    chunk_size=st.integers(2, 24),
    lengths=st.lists(st.integers(1, 120), min_size=1, max_size=6),
    data=st.data(),
)
def test_every_placed_chunk_is_found(seed: int, chunk_size: int, lengths: list[int], data: st.DataObject) -> None:
    rng = np.random.default_rng(seed)
    index = FingerprintIndex(initial_capacity=2)
    documents = [random_tokens(rng, length, vocab=2**32 - 1) for length in lengths]  # no accidental repeats
    keys = [random_keys(rng, num_chunks(length, chunk_size)) for length in lengths]
    stored: dict[PrefixKey, TokenArray] = {}
    for document, document_keys in zip(documents, keys, strict=True):
        index.register(document, document_keys, chunk_size, source_start=0)
        stored.update(chunk_map(document, document_keys, chunk_size))
    order = data.draw(st.permutations(range(len(documents))))
    parts: list[TokenArray] = [random_tokens(rng, data.draw(st.integers(0, 30)))]
    expected: list[tuple[int, PrefixKey, int]] = []  # query start, key, source start of each placed chunk
    position = len(parts[0])
    for document_idx in order:
        skip = data.draw(st.integers(0, len(documents[document_idx]) - 1))
        piece = documents[document_idx][skip:]
        first_whole_chunk = num_chunks(skip, chunk_size)
        last_chunk = len(keys[document_idx]) - 1
        # A partial last chunk is never a window hit; it is reached through its placed predecessor's link.
        is_partial = len(documents[document_idx]) % chunk_size != 0
        reachable_end = last_chunk + 1 if not is_partial or first_whole_chunk < last_chunk else last_chunk
        for chunk_idx in range(first_whole_chunk, reachable_end):
            expected.append(
                (position + chunk_idx * chunk_size - skip, keys[document_idx][chunk_idx], chunk_idx * chunk_size)
            )
        parts += [piece, random_tokens(rng, data.draw(st.integers(1, 5)))]
        position += len(piece) + len(parts[-1])
    query = np.concatenate(parts)
    matches = index.match(query, chunk_size)
    assert_verified(matches, query, stored)
    found = {(m.query_start, m.key, m.source_start) for m in matches}
    assert set(expected) <= found


@PROPERTY_SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    operations=st.lists(st.tuples(st.booleans(), st.integers(1, 90)), min_size=1, max_size=25),
)
def test_register_remove_never_loses_a_live_chunk(seed: int, operations: list[tuple[bool, int]]) -> None:
    chunk_size = 8
    rng = np.random.default_rng(seed)
    index = FingerprintIndex(initial_capacity=1, fingerprint_bits=6)
    live: dict[PrefixKey, TokenArray] = {}
    removed: set[PrefixKey] = set()
    for is_register, size in operations:
        if is_register or not live:
            document = random_tokens(rng, size, vocab=1000)
            document_keys = random_keys(rng, num_chunks(size, chunk_size))
            result = index.register(document, document_keys, chunk_size)
            aliased = {alias.key for alias in result.aliases}
            live.update({k: t for k, t in chunk_map(document, document_keys, chunk_size).items() if k not in aliased})
        else:
            victims = [key for key in live if rng.random() < 0.4]
            assert index.remove(victims) == len(victims)
            for key in victims:
                del live[key]
            removed.update(victims)
        assert len(index) == len(live)
        assert all(key in index for key in live)
        assert not any(key in index for key in removed - live.keys())
        full = [(key, tokens) for key, tokens in live.items() if len(tokens) == chunk_size]
        if full:
            separator = np.array([999_999], dtype=np.uint32)
            query = np.concatenate([part for _, tokens in full for part in (tokens, separator)])
            matches = index.match(query, chunk_size)
            assert_verified(matches, query, live)
            assert {m.key for m in matches} >= {key for key, _ in full}
            assert not {m.key for m in matches} & (removed - live.keys())


def test_forced_fingerprint_collisions_give_no_false_positives() -> None:
    rng = np.random.default_rng(2)
    index = FingerprintIndex(initial_capacity=4, fingerprint_bits=3)  # 8 fingerprints: collisions everywhere
    stored: dict[PrefixKey, TokenArray] = {}
    for _ in range(200):
        document = random_tokens(rng, 16)
        document_keys = random_keys(rng, 2)
        index.register(document, document_keys, 8)
        stored.update(chunk_map(document, document_keys, 8))
    assert len(index) == 400
    stranger = random_tokens(rng, 2000)
    assert index.match(stranger, 8) == []
    target_key, target = next(iter(stored.items()))
    query = np.concatenate([stranger[:37], target, stranger[:5]])
    matches = index.match(query, 8)
    assert [(m.query_start, m.key) for m in matches][:1] == [(37, target_key)]
    assert_verified(matches, query, stored)


def test_whole_document_with_partial_last_chunk_at_odd_offset() -> None:
    rng = np.random.default_rng(3)
    index = FingerprintIndex()
    document = random_tokens(rng, 3000)
    keys = random_keys(rng, 12)
    index.register(document, keys, 256, source_start=1000)
    query = np.concatenate([random_tokens(rng, 31), document, random_tokens(rng, 7)])
    matches = index.match(query, 256)
    assert [m.key for m in matches] == keys
    assert [m.query_start for m in matches] == [31 + 256 * i for i in range(12)]
    assert [m.source_start for m in matches] == [1000 + 256 * i for i in range(12)]
    assert matches[-1].num_tokens == 3000 - 11 * 256
    assert sum(m.num_tokens for m in matches) == 3000
    # Chunk 0 alone is indexed too.
    assert index.match(document[:256], 256) == [Match(query_start=0, num_tokens=256, key=keys[0], source_start=1000)]


def test_dedup_content_first_writer_wins() -> None:
    rng = np.random.default_rng(4)
    index = FingerprintIndex()
    document = random_tokens(rng, 40)
    first_keys, second_keys = random_keys(rng, 3), random_keys(rng, 3)
    assert index.register(document, first_keys, 16).num_added == 3
    result = index.register(document, second_keys, 16)
    assert result.num_added == 0
    assert result.aliases == tuple(
        Alias(key=new, existing_key=old) for new, old in zip(second_keys, first_keys, strict=True)
    )
    assert index.register(document, first_keys, 16).num_already_indexed == 3
    assert len(index) == 3
    assert [m.key for m in index.match(document, 16)] == first_keys
    assert second_keys[0] not in index


def test_growth_and_id_reuse_after_remove() -> None:
    rng = np.random.default_rng(5)
    index = FingerprintIndex(initial_capacity=1)
    documents = [random_tokens(rng, 64) for _ in range(300)]
    keys = [random_keys(rng, 4) for _ in documents]
    for document, document_keys in zip(documents, keys, strict=True):
        index.register(document, document_keys, 16)
    assert len(index) == 1200
    rows_before = index.memory_bytes
    assert index.remove(key for document_keys in keys[:150] for key in document_keys) == 600
    assert index.remove(keys[0]) == 0
    fresh = [random_tokens(rng, 64) for _ in range(150)]
    fresh_keys = [random_keys(rng, 4) for _ in fresh]
    for document, document_keys in zip(fresh, fresh_keys, strict=True):
        index.register(document, document_keys, 16)
    assert index.memory_bytes == rows_before  # removed ids were reused: nothing grew
    for document, document_keys in zip(documents[150:] + fresh, keys[150:] + fresh_keys, strict=True):
        assert [m.key for m in index.match(document, 16)] == document_keys
    for document in documents[:150]:
        assert index.match(document, 16) == []


def test_remove_unlinks_predecessors() -> None:
    rng = np.random.default_rng(6)
    index = FingerprintIndex()
    document = random_tokens(rng, 40)  # chunks of 16, 16, 8
    keys = random_keys(rng, 3)
    index.register(document, keys, 16)
    assert index.remove([keys[2]]) == 1
    assert [m.key for m in index.match(document, 16)] == keys[:2]
    assert index.neighbours([keys[1]])[0][1] is None, "no next link to a removed chunk"
    assert index.remove([keys[0]]) == 1
    assert index.neighbours([keys[1]]) == [(None, None)], "nor a prev link"


def test_memory_per_chunk_at_200k_chunks() -> None:
    rng = np.random.default_rng(7)
    index = FingerprintIndex()
    chunk_size = 4
    tokens = random_tokens(rng, 200_000 * chunk_size, vocab=2**31)
    index.register(tokens, random_keys(rng, 200_000), chunk_size)
    assert len(index) == 200_000
    assert index.memory_bytes / len(index) <= 64


def test_bad_inputs_raise_with_the_fix() -> None:
    index = FingerprintIndex()
    with pytest.raises(InvalidInputError, match="expected 2"):
        index.register(np.arange(20, dtype=np.uint32), [PrefixKey(b"k" * 16)], 16)
    with pytest.raises(ConfigError, match="chunk_size=0"):
        index.match(np.arange(20, dtype=np.uint32), 0)
    with pytest.raises(ConfigError, match="fingerprint_bits"):
        FingerprintIndex(fingerprint_bits=0)
    assert index.match(np.arange(3, dtype=np.uint32), 16) == []
    assert b"short" not in index


def test_a_key_is_indexed_once() -> None:
    rng = np.random.default_rng(8)
    index = FingerprintIndex()
    keys = random_keys(rng, 2)
    index.register(random_tokens(rng, 32), keys, 16)
    result = index.register(random_tokens(rng, 32), keys, 16)  # same keys, other tokens: a caller bug, not a dup
    assert (result.num_added, result.num_already_indexed, len(index)) == (0, 2, 2)
    assert index.remove(keys) == 2
    assert len(index) == 0


def test_concurrent_register_and_match() -> None:
    rng = np.random.default_rng(9)
    index = FingerprintIndex(initial_capacity=1)
    documents = [random_tokens(rng, 100) for _ in range(200)]
    keys = [random_keys(rng, num_chunks(100, 16)) for _ in documents]
    probe = documents[0]
    index.register(probe, keys[0], 16)

    def writer(first: int) -> None:
        for document, document_keys in zip(documents[first::2], keys[first::2], strict=True):
            index.register(document, document_keys, 16)

    threads = [threading.Thread(target=writer, args=(first,)) for first in (0, 1)]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        assert [m.key for m in index.match(probe, 16)] == keys[0]
    for thread in threads:
        thread.join()
    assert len(index) == 200 * num_chunks(100, 16)


@PROPERTY_SETTINGS
@given(seed=st.integers(0, 2**32 - 1), fingerprint_bits=st.integers(1, 12))
def test_colliding_fingerprints_match_like_full_ones(seed: int, fingerprint_bits: int) -> None:
    """The exact path (taken after a collision) returns what the fast path returns without collisions."""
    rng = np.random.default_rng(seed)
    colliding = FingerprintIndex(initial_capacity=1, fingerprint_bits=fingerprint_bits)
    full = FingerprintIndex(initial_capacity=1)
    documents = [random_tokens(rng, int(rng.integers(1, 80)), vocab=2**32 - 1) for _ in range(8)]
    for document in documents:
        document_keys = random_keys(rng, num_chunks(len(document), 8))
        colliding.register(document, document_keys, 8)
        full.register(document, document_keys, 8)
    parts = [random_tokens(rng, int(rng.integers(0, 9)))]
    for document_idx in rng.permutation(len(documents)).tolist():
        parts += [documents[document_idx][int(rng.integers(0, 9)) :], random_tokens(rng, int(rng.integers(1, 4)))]
    query = np.concatenate(parts)
    assert colliding.match(query, 8) == full.match(query, 8)


def test_repeated_content_links_to_itself_and_terminates() -> None:
    index = FingerprintIndex()
    keys = [PrefixKey(bytes([i]) * 16) for i in range(3)]
    result = index.register(np.full(10, 7, dtype=np.uint32), keys, 4)  # chunks 7777 7777 77
    assert result.aliases == (Alias(key=keys[1], existing_key=keys[0]),)
    matches = index.match(np.full(11, 7, dtype=np.uint32), 4)
    assert [(m.query_start, m.num_tokens, m.key) for m in matches] == [(0, 4, keys[0]), (4, 4, keys[0])]


# -- bulk registration (the rebuild at open) --------------------------------------------------------------------


def runs_of(
    documents: list[TokenArray], keys: list[list[PrefixKey]], chunk_size: int
) -> tuple[TokenArray, np.ndarray, np.ndarray, np.ndarray]:
    """The documents as ``register_runs`` takes them: tokens, chunk offsets, source starts, run offsets."""
    chunk_offsets, source_starts, run_offsets, position = [0], [], [0], 0
    for document in documents:
        for start in range(0, len(document), chunk_size):
            position += min(chunk_size, len(document) - start)
            chunk_offsets.append(position)
            source_starts.append(start)
        run_offsets.append(len(source_starts))
    assert len(source_starts) == sum(len(document_keys) for document_keys in keys)
    return (
        np.concatenate(documents),
        np.asarray(chunk_offsets, dtype=np.int64),
        np.asarray(source_starts, dtype=np.int64),
        np.asarray(run_offsets, dtype=np.int64),
    )


@PROPERTY_SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    chunk_size=st.integers(2, 24),
    lengths=st.lists(st.integers(1, 90), min_size=1, max_size=8),
    fingerprint_bits=st.sampled_from([6, 64]),
    data=st.data(),
)
def test_register_runs_is_one_register_per_run(
    seed: int, chunk_size: int, lengths: list[int], fingerprint_bits: int, data: st.DataObject
) -> None:
    rng = np.random.default_rng(seed)
    documents = [random_tokens(rng, length, vocab=1000) for length in lengths]
    keys = [random_keys(rng, num_chunks(length, chunk_size)) for length in lengths]
    for copy_idx in data.draw(st.lists(st.integers(0, len(lengths) - 1), max_size=3)):
        documents.append(documents[copy_idx])  # equal content under new keys: aliases
        keys.append(random_keys(rng, len(keys[copy_idx])))
    for again_idx in data.draw(st.lists(st.integers(0, len(lengths) - 1), max_size=2)):
        documents.append(documents[again_idx])  # the same keys again: already indexed
        keys.append(keys[again_idx])
    one_by_one = FingerprintIndex(initial_capacity=1, fingerprint_bits=fingerprint_bits)
    results = [one_by_one.register(document, k, chunk_size) for document, k in zip(documents, keys, strict=True)]
    bulk = FingerprintIndex(initial_capacity=1, fingerprint_bits=fingerprint_bits)
    tokens, chunk_offsets, source_starts, run_offsets = runs_of(documents, keys, chunk_size)

    contents = bulk.chunk_contents(tokens, chunk_offsets[:-1], chunk_offsets[1:])
    result = bulk.register_runs(contents, [k for document_keys in keys for k in document_keys], source_starts,
                                run_offsets, chunk_size)  # fmt: skip

    assert result.num_added == sum(r.num_added for r in results)
    assert result.num_already_indexed == sum(r.num_already_indexed for r in results)
    assert result.aliases == tuple(alias for r in results for alias in r.aliases)
    assert len(bulk) == len(one_by_one)
    separator = np.array([999_999], dtype=np.uint32)
    query = np.concatenate([part for document in documents for part in (separator, document)])
    assert bulk.match(query, chunk_size) == one_by_one.match(query, chunk_size)
    for document in documents:
        assert bulk.find_contents(document, chunk_size) == one_by_one.find_contents(document, chunk_size)
    every_key = [key for document_keys in keys for key in document_keys]
    assert bulk.neighbours(every_key) == one_by_one.neighbours(every_key), "prev and next links alike"


def test_chunk_contents_hash_each_span_like_register() -> None:
    rng = np.random.default_rng(11)
    tokens = random_tokens(rng, 100, vocab=2**32 - 1)
    offsets = np.array([0, 16, 17, 40, 100], dtype=np.int64)
    contents = FingerprintIndex(fingerprint_bits=20).chunk_contents(tokens, offsets[:-1], offsets[1:])
    for span, (begin, end) in enumerate(itertools.pairwise(offsets)):
        assert contents.fingerprints[span] == block_fingerprints(tokens[begin:end], end - begin)[0] & (2**20 - 1)
        assert contents.verifications[span] == xxhash.xxh3_64_intdigest(tokens[begin:end].tobytes())
    assert contents.lengths.tolist() == [16, 1, 23, 60]
    reordered = contents.take(np.array([3, 0], dtype=np.int64))
    assert reordered.lengths.tolist() == [60, 16] and len(reordered) == 2
    joined = ChunkContents.concatenate([contents, reordered], fingerprint_bits=20)
    assert joined.lengths.tolist() == [16, 1, 23, 60, 60, 16]


def test_bulk_registration_refuses_bad_input_with_the_fix() -> None:
    index = FingerprintIndex()
    tokens = np.arange(40, dtype=np.uint32)
    keys = [PrefixKey(bytes([n]) * 16) for n in range(3)]
    contents = index.chunk_contents(tokens, np.array([0, 16, 32]), np.array([16, 32, 40]))
    starts = np.array([0, 16, 32])
    with pytest.raises(InvalidInputError, match="chunk spans must lie in"):
        index.chunk_contents(tokens, np.array([0, 16]), np.array([16, 16]))  # an empty chunk
    with pytest.raises(InvalidInputError, match="chunk spans must lie in"):
        index.chunk_contents(tokens, np.array([30]), np.array([41]))  # past the end
    with pytest.raises(InvalidInputError, match="chunk spans must lie in"):
        index.chunk_contents(tokens, np.array([0, 5]), np.array([4]))
    with pytest.raises(InvalidInputError, match="3 keys and 2 source starts"):
        index.register_runs(contents, keys, starts[:2], np.array([0, 3]), 16)
    with pytest.raises(InvalidInputError, match="run_offsets must rise"):
        index.register_runs(contents, keys, starts, np.array([0, 0, 3]), 16)
    with pytest.raises(InvalidInputError, match="over chunk_size=8"):
        index.register_runs(contents, keys, starts, np.array([0, 3]), 8)  # chunks longer than chunk_size
    with pytest.raises(ConfigError, match="source start"):
        index.register_runs(contents, keys, np.array([0, 16, 2**32 - 4]), np.array([0, 3]), 16)
    with pytest.raises(InvalidInputError, match="16 bytes"):
        index.register_runs(contents, [keys[0], keys[1], PrefixKey(b"short")], starts, np.array([0, 3]), 16)
    with pytest.raises(ConfigError, match="fingerprint_bits=64 cannot be registered"):
        FingerprintIndex(fingerprint_bits=8).register_runs(contents, keys, starts, np.array([0, 3]), 16)
    assert len(index) == 0
    assert index.register_runs(contents, keys, starts, np.array([0, 1, 3]), 16).num_added == 3
