"""The content index rebuild at open (issue 3, persistence): a reopened data dir's index finds every document, whole.

The store-level tests reopen real data dirs (LMDB under tmp_path); the property tests feed a rebuild records in any
order (``sequence_records.rebuild_from``), with parent keys dropped (meta v1), shared prefixes, duplicates and
corrupt parent cycles.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import KVLayout, TieredStore
from kvstore.config import StoreConfig
from kvstore.content.catalog import ContentCatalog, ResidencyCheck
from kvstore.keys import PrefixKey, TokenArray, as_token_array, prefix_keys
from kvstore.plan import LookupPlan
from kvstore.tiers.base import TierName
from kvstore.tiers.disk.tier import DiskTier
from tests.content.sequence_records import SequenceChunk, rebuild_from

CHUNK = 8
VOCAB = 50_000
PROPERTY_SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LAYOUT = KVLayout(model_id="test/rebuild", num_layers=1, num_kv_heads=1, head_dim=2)  # 8 bytes per token


def blend_config(tmp_path: Path) -> StoreConfig:
    return StoreConfig(
        tiers=(TierName.DISK,),
        chunk_size=CHUNK,
        data_dir=tmp_path / "data",
        disk_capacity_bytes=64 << 20,
        enable_blend=True,
    )


def documents_of(rng: np.random.Generator, lengths: Sequence[int]) -> list[TokenArray]:
    return [as_token_array(rng.integers(0, VOCAB, size=length)) for length in lengths]


def query_of(
    rng: np.random.Generator, documents: Sequence[TokenArray], order: Sequence[int], gaps: Sequence[int]
) -> tuple[TokenArray, list[int]]:
    """Random tokens, then each document of ``order`` after a gap of random tokens; returns where each landed."""
    parts, starts, position = [], [], 0
    for document_idx, gap in zip(order, gaps, strict=True):
        parts += [rng.integers(0, VOCAB, size=gap), documents[document_idx]]
        starts.append(position + gap)
        position += gap + len(documents[document_idx])
    parts.append(rng.integers(0, VOCAB, size=5))
    return as_token_array(np.concatenate(parts)), starts


def covered_tokens(plan: LookupPlan, document: TokenArray, start: int, keys: Sequence[PrefixKey]) -> int:
    """Tokens of the document at ``start`` that the plan covers with the document's own chunks."""
    by_start = {segment.start: segment for segment in plan.segments}
    covered = 0
    for chunk_idx, key in enumerate(keys):
        segment = by_start.get(start + chunk_idx * CHUNK)
        if segment is not None and segment.key == key and segment.source_start == chunk_idx * CHUNK:
            covered += segment.num_tokens
    return covered


def store_documents(store: TieredStore, layout: KVLayout, documents: Sequence[TokenArray]) -> None:
    for document in documents:
        kv = torch.zeros(layout.chunk_shape(len(document)), dtype=layout.dtype.torch_dtype)
        assert store.store(document, kv).num_rejected_chunks == 0
    store.flush()


def as_meta_v1(value: bytes) -> bytes:
    """A meta value rewritten as version 1 (written before parent keys existed): the 16-byte parent key dropped,
    version 1, resealed (``kvstore.tiers.frames.meta``: checksum = xxh3_64 of bytes [0, 48) and [56, end))."""
    old = bytearray(value[:56]) + value[72:]
    struct.pack_into("<H", old, 0, 1)
    struct.pack_into("<Q", old, 48, xxhash.xxh3_64_intdigest(bytes(old[:48] + old[56:])))
    return bytes(old)


def rewrite_as_meta_v1(data_dir: Path, keys: set[PrefixKey]) -> None:
    """Turn these chunks' meta records into version 1, behind the (closed) store's back."""
    env = lmdb.open(str(data_dir), max_dbs=8)
    try:
        with env.begin(write=True) as txn:
            meta_db = env.open_db(b"meta", txn=txn)
            for key in keys:
                value = txn.get(key, db=meta_db)
                assert value is not None
                txn.put(key, as_meta_v1(bytes(value)), db=meta_db)
    finally:
        env.close()


# -- through a real store ---------------------------------------------------------------------------------------


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    lengths=st.lists(st.integers(CHUNK, 6 * CHUNK), min_size=1, max_size=5),
    data=st.data(),
)
def test_a_reopened_store_finds_every_document_at_any_offset_to_its_partial_end(
    tmp_path_factory: pytest.TempPathFactory, seed: int, lengths: list[int], data: st.DataObject
) -> None:
    rng = np.random.default_rng(seed)
    documents = documents_of(rng, lengths)
    keys = [prefix_keys(LAYOUT.namespace, document, CHUNK) for document in documents]
    order = data.draw(st.permutations(range(len(documents))))
    gaps = data.draw(st.lists(st.integers(0, CHUNK + 3), min_size=len(order), max_size=len(order)))
    query, starts = query_of(rng, documents, order, gaps)
    config = blend_config(tmp_path_factory.mktemp("store"))
    with TieredStore(LAYOUT, config) as live:
        store_documents(live, LAYOUT, documents)
        live_plan = live.lookup(query)
        live.release(live_plan)

    with TieredStore(LAYOUT, config) as reopened:
        stats = reopened.stats().catalog
        assert stats is not None and stats.num_entries == sum(len(document_keys) for document_keys in keys)
        plan = reopened.lookup(query)
        reopened.release(plan)

    for document_idx, start in zip(order, starts, strict=True):
        document = documents[document_idx]
        assert covered_tokens(plan, document, start, keys[document_idx]) == len(document), "coverage must be 1.0"
    assert [(s.start, s.num_tokens, s.key, s.source_start, s.exact) for s in plan.segments] == [
        (s.start, s.num_tokens, s.key, s.source_start, s.exact) for s in live_plan.segments
    ], "the rebuilt index must plan exactly what the live one planned"


def test_chunks_written_by_meta_v1_are_indexed_without_next_links(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    documents = documents_of(rng, [5 * CHUNK + 3, 4 * CHUNK + 1, 3 * CHUNK])
    keys = [prefix_keys(LAYOUT.namespace, document, CHUNK) for document in documents]
    config = blend_config(tmp_path)
    with TieredStore(LAYOUT, config) as live:
        store_documents(live, LAYOUT, documents)
    rewrite_as_meta_v1(config.data_dir, set(keys[0]) | set(keys[2]))  # document 1 keeps its parent keys
    disk = DiskTier.open_existing(config.data_dir)
    try:
        parents = {record.key: record.parent_key for record in disk.iter_records()}
    finally:
        disk.close()
    assert all(parents[key] is None for key in keys[0] + keys[2])
    assert [parents[key] for key in keys[1]] == [None, *keys[1][:-1]]

    with TieredStore(LAYOUT, config) as reopened:
        stats = reopened.stats().catalog
        assert stats is not None and stats.num_entries == sum(len(document_keys) for document_keys in keys)
        query, starts = query_of(rng, documents, [2, 0, 1], [3, 5, 2])
        plan = reopened.lookup(query)
        reopened.release(plan)

    coverage = [covered_tokens(plan, documents[i], start, keys[i]) for i, start in zip([2, 0, 1], starts, strict=True)]
    # v1: every full chunk is found by its own window; the partial last chunk (3 tokens) needed a next link.
    assert coverage == [3 * CHUNK, 5 * CHUNK, 4 * CHUNK + 1]


def test_the_disk_recovery_pass_rebuilds_the_same_index_as_a_second_pass(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    documents = documents_of(rng, [5 * CHUNK + 3, 4 * CHUNK + 1, 3 * CHUNK, 2])
    keys = [prefix_keys(LAYOUT.namespace, document, CHUNK) for document in documents]
    config = blend_config(tmp_path)
    with TieredStore(LAYOUT, config) as live:
        store_documents(live, LAYOUT, documents)
    residency = ResidencyCheck(is_resident=lambda key: True, in_transit=lambda key: False)
    one_pass, two_pass = ContentCatalog(CHUNK, residency), ContentCatalog(CHUNK, residency)
    rebuild = one_pass.start_rebuild()
    disk = DiskTier(config.data_dir, LAYOUT, CHUNK, config.disk_capacity_bytes, content_records=rebuild.add)
    try:
        second_pass = two_pass.start_rebuild()
        for batch in disk.iter_content_records():
            second_pass.add(batch)
        assert rebuild.finish() == second_pass.finish() == sum(map(len, keys))
        query, _ = query_of(rng, documents, [3, 1, 0, 2], [1, 4, 0, 6])
        assert one_pass.index.match(query, CHUNK) == two_pass.index.match(query, CHUNK) != []
        with pytest.raises(AssertionError, match="after finish"):
            rebuild.add(next(disk.iter_content_records()))
    finally:
        disk.close()
        one_pass.close()
        two_pass.close()


# -- rebuild on its own: any order, lost parents, shared prefixes, duplicates, cycles -----------------------------


@pytest.fixture
def catalog() -> Iterator[ContentCatalog]:
    opened = ContentCatalog(CHUNK, ResidencyCheck(is_resident=lambda key: True, in_transit=lambda key: False))
    yield opened
    opened.close()


def sequence_chunks(tokens: TokenArray, keys: Sequence[PrefixKey], *, with_parents: bool = True) -> list[SequenceChunk]:
    return [
        SequenceChunk(
            key=key,
            parent_key=keys[index - 1] if index and with_parents else None,
            source_start=index * CHUNK,
            tokens=tokens[index * CHUNK : (index + 1) * CHUNK],
        )
        for index, key in enumerate(keys)
    ]


def match_coverage(catalog: ContentCatalog, document: TokenArray, keys: Sequence[PrefixKey], offset: int) -> int:
    """Tokens of the document, placed at ``offset`` in a query, that the index matches with its own chunks."""
    query = as_token_array(np.concatenate([np.full(offset, VOCAB + 1), document, np.full(3, VOCAB + 2)]))
    by_start = {match.query_start: match for match in catalog.index.match(query, CHUNK)}
    covered = 0
    for chunk_idx, key in enumerate(keys):
        found = by_start.get(offset + chunk_idx * CHUNK)
        if found is not None and found.key == key and found.source_start == chunk_idx * CHUNK:
            covered += found.num_tokens
    return covered


@PROPERTY_SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    lengths=st.lists(st.integers(1, 7 * CHUNK), min_size=1, max_size=8),
    data=st.data(),
)
def test_rebuild_indexes_every_chunk_in_any_order_and_links_what_it_can(
    seed: int, lengths: list[int], data: st.DataObject
) -> None:
    rng = np.random.default_rng(seed)
    documents = documents_of(rng, lengths)
    keys = [prefix_keys(LAYOUT.namespace, document, CHUNK) for document in documents]
    without_parents = data.draw(st.sets(st.integers(0, len(documents) - 1)))
    records = [
        chunk
        for index, (document, document_keys) in enumerate(zip(documents, keys, strict=True))
        for chunk in sequence_chunks(document, document_keys, with_parents=index not in without_parents)
    ]
    shuffled = data.draw(st.permutations(records))
    catalog = ContentCatalog(CHUNK, ResidencyCheck(is_resident=lambda key: True, in_transit=lambda key: False))
    try:
        assert rebuild_from(catalog, shuffled) == len(records)
        assert len(catalog.index) == len(records)
        for index, (document, document_keys) in enumerate(zip(documents, keys, strict=True)):
            offset = data.draw(st.integers(0, 2 * CHUNK))
            full_tokens = (len(document) // CHUNK) * CHUNK
            if full_tokens == 0:
                expected = 0  # a lone partial chunk is only ever found through a link
            elif index in without_parents:
                expected = full_tokens  # meta v1: no next links, the partial last chunk stays unmatched
            else:
                expected = len(document)
            assert match_coverage(catalog, document, document_keys, offset) == expected
    finally:
        catalog.close()


def test_sequences_sharing_a_prefix_both_keep_their_partial_ends(catalog: ContentCatalog) -> None:
    rng = np.random.default_rng(5)
    prefix, tail_a, tail_b = documents_of(rng, [2 * CHUNK, 2 * CHUNK + 3, CHUNK + 5])
    first, second = np.concatenate([prefix, tail_a]), np.concatenate([prefix, tail_b])
    keys_first = prefix_keys(LAYOUT.namespace, first, CHUNK)
    keys_second = prefix_keys(LAYOUT.namespace, second, CHUNK)
    assert keys_first[:2] == keys_second[:2]
    records = sequence_chunks(first, keys_first) + sequence_chunks(second, keys_second)[2:]

    assert rebuild_from(catalog, records) == len(keys_first) + len(keys_second) - 2
    for document, keys in ((first, keys_first), (second, keys_second)):
        assert match_coverage(catalog, document, keys, 1) == len(document)


def test_duplicates_cycles_and_bad_lengths_are_survived(
    catalog: ContentCatalog, caplog: pytest.LogCaptureFixture
) -> None:
    rng = np.random.default_rng(6)
    (document,) = documents_of(rng, [3 * CHUNK])
    keys = prefix_keys(LAYOUT.namespace, document, CHUNK)
    chunks = sequence_chunks(document, keys)
    looped = [  # corrupt parents: chunk 0's parent is chunk 2, which no honest write produces
        SequenceChunk(key=chunk.key, parent_key=keys[2] if index == 0 else chunk.parent_key,
                      source_start=chunk.source_start, tokens=chunk.tokens)
        for index, chunk in enumerate(chunks)
    ]  # fmt: skip
    too_long = SequenceChunk(key=PrefixKey(b"L" * 16), parent_key=None, source_start=0, tokens=document[: CHUNK + 1])
    empty = SequenceChunk(key=PrefixKey(b"E" * 16), parent_key=None, source_start=0, tokens=document[:0])

    with caplog.at_level(logging.WARNING, logger="kvstore.content.catalog"):
        assert rebuild_from(catalog, [*looped, too_long, chunks[1], empty]) == 3

    assert len(catalog.index) == 3
    assert "skipped 2 chunks of no tokens" in caplog.text
    assert "3 chunks form cycles of parent keys" in caplog.text
    assert match_coverage(catalog, document, keys, 2) == 3 * CHUNK  # full chunks: found by their windows


def test_nothing_to_rebuild(catalog: ContentCatalog) -> None:
    assert rebuild_from(catalog, []) == 0
    assert len(catalog.index) == 0
