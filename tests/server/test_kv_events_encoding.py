"""The hand-written msgpack of vLLM's KV event structs, checked field by field against a msgpack decoder for any
records (the vLLM suite decodes the same bytes with vLLM's msgspec structs)."""

from __future__ import annotations

import msgpack
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvstore.keys import PrefixKey
from kvstore.server.kv_events.encoding import all_blocks_cleared, batch, block_removed, blocks_resident, blocks_stored
from kvstore.tiers.base import ChunkRecord

keys = st.binary(min_size=16, max_size=16).map(PrefixKey)


def chunk_record(key: PrefixKey, parent: PrefixKey | None, tokens: list[int]) -> ChunkRecord:
    return ChunkRecord(key=key, source_start=0, tokens=np.array(tokens, dtype="<u4"), parent_key=parent)


records = st.builds(chunk_record, keys, st.none() | keys, st.lists(st.integers(0, 2**32 - 1), max_size=300))


@given(st.lists(records, max_size=40), st.lists(st.sampled_from(["GPU", "CPU", "STORAGE"]), min_size=40, max_size=40),
       st.integers(1, 4096), st.floats(0, 2e9))  # fmt: skip
def test_stored_removed_and_cleared_events_decode_to_their_fields(
    chunk_records: list[ChunkRecord], mediums: list[str], block_size: int, ts: float
) -> None:
    used_mediums = mediums[: len(chunk_records)]
    events = blocks_stored(chunk_records, block_size, used_mediums)
    events += blocks_resident([record.key for record in chunk_records], block_size, "CPU")
    events += [block_removed([record.key for record in chunk_records], "STORAGE"), all_blocks_cleared()]
    decoded_ts, decoded = msgpack.unpackb(batch(ts, events))
    assert decoded_ts == ts and len(decoded) == 2 * len(chunk_records) + 2
    for record, medium, event in zip(chunk_records, used_mediums, decoded, strict=False):
        assert event == {
            "type": "BlockStored", "block_hashes": [record.key], "parent_block_hash": record.parent_key,
            "token_ids": record.tokens.tolist(), "block_size": block_size, "lora_id": None, "medium": medium,
            "lora_name": None,
        }  # fmt: skip
    for record, event in zip(chunk_records, decoded[len(chunk_records) :], strict=False):
        assert event["block_hashes"] == [record.key] and event["token_ids"] == [] and event["parent_block_hash"] is None
    assert decoded[-2] == {"type": "BlockRemoved", "block_hashes": [r.key for r in chunk_records], "medium": "STORAGE"}
    assert decoded[-1] == {"type": "AllBlocksCleared"}
