"""decode_meta_batch: a batch decodes into arrays exactly what decode_meta makes of each record, defects included;
content records hold the same; read_meta_batches cuts any stream of records into batches without losing one."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.keys import PrefixKey
from kvstore.tiers.disk.meta_batch import decode_meta_batch, read_meta_batches
from kvstore.tiers.frames.meta import decode_meta
from tests.tiers.frames.test_meta import DEFECTS, spoiled, stored_chunk

RECORDS = st.lists(
    st.tuples(st.integers(0, 2**32 - 1), st.integers(1, 300), st.sampled_from(DEFECTS), st.integers(0, 10**6)),
    max_size=12,
)


def batch_inputs(records: list[tuple[int, int, str, int]]) -> tuple[list[PrefixKey], list[bytes]]:
    chunks = [stored_chunk(seed, num_tokens, with_parent=seed % 3 > 0) for seed, num_tokens, _, _ in records]
    values = [spoiled(chunk, defect, position) for chunk, (_, _, defect, position) in zip(chunks, records, strict=True)]
    return [chunk.key for chunk in chunks], values


@settings(max_examples=80, deadline=None)
@given(records=RECORDS, bad_key_at=st.one_of(st.none(), st.integers(0, 11)), as_views=st.booleans())
def test_a_batch_decodes_what_each_record_decodes_to(
    records: list[tuple[int, int, str, int]], bad_key_at: int | None, as_views: bool
) -> None:
    keys, values = batch_inputs(records)
    if bad_key_at is not None and bad_key_at < len(keys):
        keys[bad_key_at] = PrefixKey(keys[bad_key_at][:7])  # a key of another length: never readable
    expected = [(key, chunk) for key, value in zip(keys, values, strict=True) if (chunk := decode_meta(key, value))]

    batch = decode_meta_batch(
        [memoryview(key) for key in keys] if as_views else keys,
        [memoryview(value) for value in values] if as_views else values,
    )

    assert batch.keys == [key for key, _ in expected]
    assert batch.broken_keys == [key for key, value in zip(keys, values, strict=True) if not decode_meta(key, value)]
    assert batch.key_words.tobytes() == b"".join(batch.keys)
    for index, (_, chunk) in enumerate(expected):
        assert batch.num_tokens[index] == chunk.num_tokens
        assert batch.source_starts[index] == chunk.source_start
        assert batch.raw_bytes[index] == chunk.raw_bytes
        assert batch.stored_bytes[index] == chunk.stored_bytes
        assert batch.num_frames[index] == chunk.num_frames
        assert batch.frame_bytes[index] == chunk.frame_bytes
        assert batch.last_access_ns[index] == chunk.last_access_ns
        assert batch.words[batch.token_starts[index] : batch.token_ends[index]].tolist() == chunk.tokens.tolist()
    content = batch.content()
    assert content.parent_keys == [chunk.parent_key for _, chunk in expected]
    assert content.source_starts.tolist() == [chunk.source_start for _, chunk in expected]


@settings(max_examples=40, deadline=None)
@given(records=RECORDS, keep_seed=st.integers(0, 2**32 - 1))
def test_content_records_keep_what_the_mask_keeps(records: list[tuple[int, int, str, int]], keep_seed: int) -> None:
    keys, values = batch_inputs(records)
    batch = decode_meta_batch(keys, values)
    keep = np.random.default_rng(keep_seed).random(len(batch)) < 0.5

    content = batch.content(keep)

    kept = [index for index in range(len(batch)) if keep[index]]
    assert list(content.keys) == [batch.keys[index] for index in kept]
    assert content.key_words.tobytes() == b"".join(content.keys)
    assert content.parent_keys == [batch.content().parent_keys[index] for index in kept]
    assert [content.tokens[start:end].tolist() for start, end in zip(content.token_starts, content.token_ends,
                                                                     strict=True)] == [
        batch.words[batch.token_starts[index] : batch.token_ends[index]].tolist() for index in kept
    ]  # fmt: skip


@settings(max_examples=30, deadline=None)
@given(records=RECORDS, batch_records=st.integers(1, 5))
def test_batches_of_a_stream_hold_every_record_once(
    records: list[tuple[int, int, str, int]], batch_records: int
) -> None:
    keys, values = batch_inputs(records)
    whole = decode_meta_batch(keys, values)

    batches = list(read_meta_batches(iter(zip(keys, values, strict=True)), batch_records))

    assert all(1 <= len(batch) + len(batch.broken_keys) <= batch_records for batch in batches)
    assert [key for batch in batches for key in batch.keys] == whole.keys
    assert [key for batch in batches for key in batch.broken_keys] == whole.broken_keys


def test_an_empty_batch_decodes_to_nothing() -> None:
    batch = decode_meta_batch([], [])
    assert len(batch) == 0 and batch.broken_keys == [] and batch.key_words.shape == (0, 2)
    assert list(read_meta_batches(iter([]), 4)) == []
