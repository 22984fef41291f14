"""Document hit counts (issue 5): which stored documents lookups reuse, over plans of a real ``TieredStore``; their
bounds; and the file a server keeps them in."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore import StoreConfig, TieredStore
from kvstore.errors import StorageError
from kvstore.keys import PrefixKey, as_token_array, chunk_bounds, prefix_keys
from kvstore.server.usage.documents import DocumentHits
from kvstore.server.usage.documents_file import (
    DOCUMENT_HITS_FILE,
    DocumentHitsSaver,
    SavedDocumentHits,
    load_document_hits,
    save_document_hits,
)
from kvstore.tiers.base import TierName
from tests.factories import make_kv, make_tokens
from tests.server.conftest import CHUNK_SIZE, SERVER_LAYOUT


class Clock:
    """Wall-clock ns that the test moves."""

    def __init__(self) -> None:
        self.now_ns = 1_700_000_000 * 10**9

    def __call__(self) -> int:
        return self.now_ns


@pytest.fixture
def store() -> Iterator[TieredStore]:
    config = StoreConfig(tiers=(TierName.CPU,), chunk_size=CHUNK_SIZE, cpu_capacity_bytes=1 << 22, enable_blend=True)
    with TieredStore(SERVER_LAYOUT, config) as opened:
        yield opened


def stored(store: TieredStore, documents: DocumentHits, tokens: np.ndarray) -> PrefixKey:
    """Store ``tokens`` as the server does: in the store, then named a document (its first key; empty when none)."""
    token_array = as_token_array(tokens)
    store.store(token_array, make_kv(SERVER_LAYOUT, len(token_array), seed=len(token_array)))
    keys = prefix_keys(SERVER_LAYOUT.namespace, token_array, CHUNK_SIZE)
    return documents.add_stored(keys, token_array, chunk_bounds(token_array, CHUNK_SIZE)) or PrefixKey(b"")


def looked_up(store: TieredStore, documents: DocumentHits, tokens: np.ndarray, *, blend: bool = False) -> None:
    token_array = as_token_array(tokens)
    plan = store.lookup(token_array, blend=blend)
    store.release(plan)
    documents.add_plan(plan, token_array)


def test_a_document_is_what_one_store_added_and_a_plan_hits_each_document_once(store: TieredStore) -> None:
    clock = Clock()
    documents = DocumentHits(clock_ns=clock)
    preamble, first, second = make_tokens(16, seed=1), make_tokens(48, seed=2), make_tokens(32, seed=3)
    first_doc = stored(store, documents, np.concatenate([preamble, first]))
    second_doc = stored(store, documents, np.concatenate([preamble, second]))
    assert stored(store, documents, np.concatenate([preamble, first])) == b"", "nothing new: no document"
    second_keys = prefix_keys(SERVER_LAYOUT.namespace, as_token_array(np.concatenate([preamble, second])), CHUNK_SIZE)
    assert second_doc == second_keys[1], "the shared preamble stays with the first document"
    assert documents.top(10) == [], "documents never hit are not in the top list"

    clock.now_ns += 5
    looked_up(store, documents, np.concatenate([preamble, first, make_tokens(7, seed=4)]))
    clock.now_ns += 5
    looked_up(store, documents, np.concatenate([preamble, second]))
    looked_up(store, documents, np.concatenate([preamble, second]))
    top = documents.top(10)
    assert [(d.first_key, d.num_hits, d.num_tokens_served) for d in top] == [
        (first_doc, 3, 16 + 48 + 16 + 16),  # once in full, twice for the preamble alone
        (second_doc, 2, 64),  # 2 chunks of 16 tokens, twice
    ]
    by_key = {d.first_key: d for d in top}
    assert by_key[first_doc].num_tokens == 64 and len(by_key[first_doc].chunk_keys) == 4
    assert by_key[second_doc].num_tokens == 32 and by_key[second_doc].first_tokens == tuple(int(t) for t in second[:16])
    assert by_key[second_doc].last_hit_ns == clock.now_ns


def test_blend_matches_count_for_the_document_they_came_from(store: TieredStore) -> None:
    documents = DocumentHits()
    document = make_tokens(64, seed=11)
    first_key = stored(store, documents, document)
    store.flush()
    prompt = np.concatenate([make_tokens(5, seed=12), document, make_tokens(3, seed=13)])
    looked_up(store, documents, prompt, blend=True)
    (top,) = documents.top(10)
    assert top.first_key == first_key and top.num_hits == 1 and top.num_tokens_served == 64


def test_chunks_stored_before_counting_are_learned_from_the_plans(store: TieredStore) -> None:
    documents = DocumentHits()
    tokens = make_tokens(40, seed=21)
    store.store(as_token_array(tokens), make_kv(SERVER_LAYOUT, 40, seed=21))  # not through add_stored
    looked_up(store, documents, tokens)
    looked_up(store, documents, np.concatenate([tokens[:32], make_tokens(9, seed=22)]))
    (top,) = documents.top(10)
    keys = prefix_keys(SERVER_LAYOUT.namespace, as_token_array(tokens), CHUNK_SIZE)
    assert top.first_key == keys[0] and top.chunk_keys == tuple(keys)
    assert (top.num_hits, top.num_tokens_served, top.num_tokens) == (2, 40 + 32, 40)


def test_memory_is_bounded_by_dropping_the_least_hit_oldest_documents(store: TieredStore) -> None:
    clock = Clock()
    documents = DocumentHits(max_documents=5, max_chunk_keys=1000, clock_ns=clock)
    texts = [make_tokens(32, seed=100 + index) for index in range(5)]
    first_keys = []
    for text in texts:
        clock.now_ns += 1
        first_keys.append(stored(store, documents, text))
    looked_up(store, documents, texts[0])  # the oldest, but hit
    clock.now_ns += 1
    stored(store, documents, make_tokens(32, seed=200))  # the sixth: trims to 4 (90% of 5)
    assert documents.num_documents == 4 and documents.num_dropped == 2
    assert documents.document_of(first_keys[0]) == first_keys[0], "the hit document stays"
    assert documents.document_of(first_keys[1]) is None and documents.document_of(first_keys[2]) is None, (
        "the oldest documents never hit go first"
    )
    by_keys = DocumentHits(max_documents=100, max_chunk_keys=5)
    for index in range(3):
        stored(store, by_keys, make_tokens(32, seed=300 + index))  # 2 chunks each
    assert by_keys.num_documents == 2 and by_keys.num_dropped == 1, "the chunk-key bound trims too"


def test_counts_round_trip_through_the_file_and_a_bad_file_is_an_error(store: TieredStore, tmp_path: Path) -> None:
    documents = DocumentHits()
    text = make_tokens(48, seed=31)
    stored(store, documents, text)
    looked_up(store, documents, text)
    saver = DocumentHitsSaver(documents, tmp_path, save_interval_s=3600)
    assert saver.save() is True and saver.save() is False, "an unchanged count is not written again"
    assert saver.save_if_due() is False
    assert sorted(path.name for path in tmp_path.iterdir()) == [DOCUMENT_HITS_FILE], "no temporary file is left"
    reloaded = DocumentHits()
    DocumentHitsSaver(reloaded, tmp_path).load()
    assert reloaded.top(10) == documents.top(10)
    looked_up(store, reloaded, text)
    assert reloaded.top(1)[0].num_hits == 2, "counting continues where the saved counts ended"
    assert load_document_hits(tmp_path / "nowhere") is None

    (tmp_path / DOCUMENT_HITS_FILE).write_bytes(b"\x81\xa7version")  # truncated msgpack
    with pytest.raises(StorageError, match="not a readable document hit count file"):
        load_document_hits(tmp_path)
    fresh = DocumentHits()
    DocumentHitsSaver(fresh, tmp_path).load()  # logged, not raised: the server starts counting afresh
    assert fresh.num_documents == 0
    save_document_hits(tmp_path, SavedDocumentHits(documents=(), saved_ns=1, num_dropped=7))
    loaded = load_document_hits(tmp_path)
    assert loaded is not None and loaded.num_dropped == 7 and loaded.documents == ()
