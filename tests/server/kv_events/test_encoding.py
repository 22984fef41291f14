"""The hand-written msgpack of vLLM's KV event structs, checked field by field against a msgpack decoder for any
records (the vLLM suite decodes the same bytes with vLLM's msgspec structs)."""

from __future__ import annotations

import msgpack
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvstore.keys import PrefixKey
from kvstore.server.kv_events.encoding import (
    MEDIUMS,
    Change,
    all_blocks_cleared,
    batch,
    block_removed,
    blocks_resident,
    blocks_stored,
    blocks_stored_batch,
    encode_changes,
)
from kvstore.tiers.base import ChunkRecord, ContentRecords, TierName

keys = st.binary(min_size=16, max_size=16).map(PrefixKey)


def chunk_record(key: PrefixKey, parent: PrefixKey | None, tokens: list[int]) -> ChunkRecord:
    return ChunkRecord(key=key, source_start=0, tokens=np.array(tokens, dtype="<u4"), parent_key=parent)


records = st.builds(chunk_record, keys, st.none() | keys, st.lists(st.integers(0, 2**32 - 1), max_size=300))


@given(st.lists(records, max_size=40, unique_by=lambda record: record.key), st.sampled_from(["GPU", "CPU", "STORAGE"]),
       st.integers(1, 4096),
       st.floats(0, 2e9))  # fmt: skip
def test_stored_removed_and_cleared_events_decode_to_their_fields(
    chunk_records: list[ChunkRecord], medium: str, block_size: int, ts: float
) -> None:
    """``blocks_stored`` groups records by block shape (token count, first chunk or not): every record is there
    once, whatever the mix."""
    pieces = [blocks_stored(chunk_records, block_size, medium)] if chunk_records else []
    pieces += blocks_resident([record.key for record in chunk_records], block_size, "CPU")
    pieces += [block_removed([record.key for record in chunk_records], "STORAGE"), all_blocks_cleared()]
    decoded_ts, decoded = msgpack.unpackb(batch(ts, pieces, 2 * len(chunk_records) + 2))
    assert decoded_ts == ts and len(decoded) == 2 * len(chunk_records) + 2
    stored = {event["block_hashes"][0]: event for event in decoded[: len(chunk_records)]}
    assert len(stored) == len({record.key for record in chunk_records})
    for record in chunk_records:
        assert stored[record.key] == {
            "type": "BlockStored", "block_hashes": [record.key], "parent_block_hash": record.parent_key,
            "token_ids": record.tokens.tolist(), "block_size": block_size, "lora_id": None, "medium": medium,
            "lora_name": None,
        }  # fmt: skip
    for record, event in zip(chunk_records, decoded[len(chunk_records) :], strict=False):
        assert event["block_hashes"] == [record.key] and event["token_ids"] == [] and event["parent_block_hash"] is None
    assert decoded[-2] == {"type": "BlockRemoved", "block_hashes": [r.key for r in chunk_records], "medium": "STORAGE"}
    assert decoded[-1] == {"type": "AllBlocksCleared"}


TIERS = (TierName.CPU, TierName.DISK, TierName.REMOTE)


@st.composite
def residency_changes(draw: st.DrawFn) -> list[Change]:
    """Changes as tiers make them: a (tier, key) is stored only while not resident and removed only while it is;
    removals come one key or several at a time."""
    pool = draw(st.lists(keys, min_size=1, max_size=6, unique=True))
    resident: set[tuple[TierName, PrefixKey]] = set()
    changes: list[Change] = []
    for _ in range(draw(st.integers(0, 60))):
        tier = draw(st.sampled_from(TIERS))
        absent = [key for key in pool if (tier, key) not in resident]
        present = [key for key in pool if (tier, key) in resident]
        if absent and (not present or draw(st.booleans())):
            key = draw(st.sampled_from(absent))
            tokens = draw(st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=20))
            changes.append((tier, chunk_record(key, draw(st.none() | keys), tokens)))
            resident.add((tier, key))
        else:
            removed = draw(st.lists(st.sampled_from(present), min_size=1, unique=True))
            changes.append((tier, tuple(removed)))
            resident -= {(tier, key) for key in removed}
    return changes


@given(residency_changes())
def test_encoded_changes_leave_a_consumer_with_exactly_the_residency_the_changes_leave(changes: list[Change]) -> None:
    """``encode_changes`` reorders events of different keys and joins removals per tier; applying its batch in order
    gives the same residency as applying the changes in order, with a ``BlockStored`` for every store."""
    by_medium = {medium: tier for tier, medium in MEDIUMS.items()}
    expected: set[tuple[TierName, PrefixKey]] = set()
    for tier, change in changes:
        if isinstance(change, ChunkRecord):
            expected.add((tier, change.key))
        else:
            expected -= {(tier, key) for key in change}
    encoded = encode_changes(changes, 16)
    _, decoded = msgpack.unpackb(batch(0.0, encoded.pieces, encoded.num_events))
    assert len(decoded) == encoded.num_events
    applied: set[tuple[TierName, PrefixKey]] = set()
    for event in decoded:
        tier = by_medium[event["medium"]]
        if event["type"] == "BlockStored":
            applied.add((tier, PrefixKey(event["block_hashes"][0])))
        else:
            applied -= {(tier, PrefixKey(key)) for key in event["block_hashes"]}
    assert applied == expected
    num_stores = sum(isinstance(change, ChunkRecord) for _, change in changes)
    assert encoded.num_stored == num_stores == sum(event["type"] == "BlockStored" for event in decoded)


def test_many_records_of_mixed_shapes_are_each_encoded_once() -> None:
    """More records than one numpy pass takes, in three block shapes: every record decodes to its own fields."""
    rng = np.random.default_rng(3)
    chunk_records = [
        chunk_record(PrefixKey(rng.bytes(16)), None if index % 7 == 0 else PrefixKey(rng.bytes(16)),
                     rng.integers(0, 2**32, 256 if index % 5 else 100, dtype=np.uint64).tolist())
        for index in range(700)
    ]  # fmt: skip
    _, decoded = msgpack.unpackb(batch(1.0, [blocks_stored(chunk_records, 256, "CPU")], len(chunk_records)))
    by_key = {event["block_hashes"][0]: event for event in decoded}
    assert len(decoded) == len(by_key) == len(chunk_records)
    for record in chunk_records:
        event = by_key[record.key]
        assert event["token_ids"] == record.tokens.tolist() and event["parent_block_hash"] == record.parent_key


def with_gaps(records: ContentRecords, gap: int) -> ContentRecords:
    """The same chunks with ``gap`` junk tokens before each one's span, as the disk tier's buffers skip headers."""
    pieces, starts = [], []
    at = 0
    for start, end in zip(records.token_starts.tolist(), records.token_ends.tolist(), strict=True):
        pieces += [np.full(gap, 0xDEAD, dtype="<u4"), records.tokens[start:end]]
        starts.append(at + gap)
        at += gap + end - start
    spans = np.array(starts, dtype=np.int64)
    return ContentRecords(
        keys=records.keys, key_words=records.key_words, parent_words=records.parent_words,
        source_starts=records.source_starts, tokens=np.concatenate([np.zeros(0, "<u4"), *pieces]),
        token_starts=spans, token_ends=spans + (records.token_ends - records.token_starts),
    )  # fmt: skip


nonzero_keys = keys.filter(lambda key: any(key))  # a parent of 16 zero bytes reads as none in record arrays


@given(st.lists(st.builds(chunk_record, keys, st.none() | nonzero_keys, st.lists(st.integers(0, 2**32 - 1),
                                                                                  max_size=300)),
                max_size=40, unique_by=lambda record: record.key),
       st.integers(0, 40), st.integers(0, 40), st.integers(0, 3))  # fmt: skip
def test_a_snapshot_encoded_from_record_arrays_is_what_the_records_encode_to(
    chunk_records: list[ChunkRecord], first: int, stop: int, gap: int
) -> None:
    """``blocks_stored_batch`` (a snapshot, from a tier's arrays) and ``blocks_stored`` (changes, from record
    objects) give a consumer the same events for the same chunks, whatever the spans' positions in the buffer."""
    first, stop = sorted((min(first, len(chunk_records)), min(stop, len(chunk_records))))
    records = with_gaps(ContentRecords.of(chunk_records), gap)
    assert records.parent_keys == [record.parent_key for record in chunk_records]
    chosen = chunk_records[first:stop]
    from_arrays = [blocks_stored_batch(records, first, stop, 256, "STORAGE")]
    from_objects = [blocks_stored(chosen, 256, "STORAGE")] if chosen else []
    events_of = [msgpack.unpackb(batch(0.0, pieces, len(chosen)))[1] for pieces in (from_arrays, from_objects)]
    by_key = [{event["block_hashes"][0]: event for event in events} for events in events_of]
    assert len(events_of[0]) == len(chosen) and by_key[0] == by_key[1]
