"""Reading a data dir's records in batches (real LMDB under tmp_path): every chunk once, in key order, across
transaction boundaries; content records hold what the chunk records hold; evicted chunks are left out."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstore.keys import as_token_array, prefix_keys
from kvstore.layout import KVLayout
from kvstore.tiers.base import ChunkRecord, ContentRecords
from kvstore.tiers.disk.tier import DiskTier
from tests.factories import make_tokens

CHUNK = 16


@pytest.fixture
def filled_tier(tmp_path: Path, small_layout: KVLayout) -> Iterator[DiskTier]:
    """A disk tier holding 5 sequences of 5 chunks (the last one partial), committed."""
    tier = DiskTier(tmp_path / "data", small_layout, CHUNK, 64 << 20)
    for seed in range(5):
        tokens = as_token_array(make_tokens(4 * CHUNK + 3 + seed, seed))
        keys = prefix_keys(small_layout.namespace, tokens, CHUNK)
        for index, key in enumerate(keys):
            piece = tokens[index * CHUNK : (index + 1) * CHUNK]
            record = ChunkRecord(
                key=key, source_start=index * CHUNK, tokens=piece, parent_key=keys[index - 1] if index else None
            )
            kv = torch.zeros(small_layout.chunk_shape(len(piece)), dtype=small_layout.dtype.torch_dtype)
            assert tier.put(record, kv)
    tier.flush()
    yield tier
    tier.close()


@pytest.mark.parametrize("batch_size", [1, 2, 7, 22, 64, 1024])
def test_every_chunk_comes_once_in_key_order_whatever_the_batch(filled_tier: DiskTier, batch_size: int) -> None:
    records = list(filled_tier.iter_records(batch_size=batch_size))
    assert [record.key for record in records] == sorted(filled_tier.keys()) and len(records) == 25

    batches = list(filled_tier.iter_content_records(batch_size=batch_size))

    assert all(1 <= len(batch) <= batch_size for batch in batches)
    assert [key for batch in batches for key in batch.keys] == [record.key for record in records]
    flat = [
        (key, parent, int(source_start), batch.tokens[start:end].tolist())
        for batch in batches
        for key, parent, source_start, start, end in zip(
            batch.keys, batch.parent_keys, batch.source_starts, batch.token_starts, batch.token_ends, strict=True
        )
    ]
    assert flat == [(record.key, record.parent_key, record.source_start, record.tokens.tolist()) for record in records]


def test_evicted_chunks_are_left_out(filled_tier: DiskTier) -> None:
    victim = sorted(filled_tier.keys())[3]
    assert filled_tier.evict(victim)
    assert victim not in [record.key for record in filled_tier.iter_records()]
    assert victim not in [key for batch in filled_tier.iter_content_records() for key in batch.keys]


def test_an_empty_data_dir_yields_nothing(tmp_path: Path, small_layout: KVLayout) -> None:
    tier = DiskTier(tmp_path / "empty", small_layout, CHUNK, 64 << 20)
    try:
        assert list(tier.iter_records()) == [] and list(tier.iter_content_records()) == []
    finally:
        tier.close()


def test_recovery_feeds_the_same_content_records_to_a_callback(filled_tier: DiskTier, small_layout: KVLayout) -> None:
    expected = [
        (key, parent, int(source_start), batch.tokens[start:end].tolist())
        for batch in filled_tier.iter_content_records()
        for key, parent, source_start, start, end in zip(
            batch.keys, batch.parent_keys, batch.source_starts, batch.token_starts, batch.token_ends, strict=True
        )
    ]
    path = filled_tier.path
    filled_tier.close()
    fed: list[tuple[bytes, bytes | None, int, list[int]]] = []

    def on_records(batch: ContentRecords) -> None:
        assert batch.key_words.tobytes() == b"".join(batch.keys)
        fed.extend(
            (key, parent, int(source_start), batch.tokens[start:end].tolist())
            for key, parent, source_start, start, end in zip(
                batch.keys, batch.parent_keys, batch.source_starts, batch.token_starts, batch.token_ends, strict=True
            )
        )

    reopened = DiskTier(path, small_layout, CHUNK, 64 << 20, content_records=on_records)
    try:
        assert fed == expected and len(fed) == 25
    finally:
        reopened.close()


def test_a_failing_content_callback_aborts_the_open_and_releases_the_dir(
    filled_tier: DiskTier, small_layout: KVLayout
) -> None:
    path = filled_tier.path
    filled_tier.close()

    def refuse(batch: ContentRecords) -> None:
        raise RuntimeError("index full")

    with pytest.raises(RuntimeError, match="index full"):
        DiskTier(path, small_layout, CHUNK, 64 << 20, content_records=refuse)
    reopened = DiskTier(path, small_layout, CHUNK, 64 << 20)  # the failed open left no owner lock behind
    try:
        assert len(reopened.keys()) == 25
    finally:
        reopened.close()
