"""The reference consumer's decoding: token ids read as arrays give what a msgpack decoder reads, whatever the
encoder chose for each int, and a mirror keeps each stored block's fields."""

from __future__ import annotations

import msgpack
import msgspec
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvstore.keys import PrefixKey
from kvstore.server.kv_events.consumer import BlockStored, KVEventBatch, ResidencyMirror, StoredBlock, token_arrays
from kvstore.server.kv_events.encoding import batch, block_removed, blocks_stored
from kvstore.tiers.base import ChunkRecord

token_lists = st.lists(st.lists(st.integers(0, 2**32 - 1), max_size=40), max_size=12)


def kvstore_items(tokens: list[int]) -> bytes:
    """Token ids as kvstore's encoder writes them (every item a ``uint 32``): the ``token_ids`` value cut out of a
    stored event, its array header then 5 bytes an item."""
    record = ChunkRecord(key=PrefixKey(bytes(range(16))), source_start=0, tokens=np.array(tokens, dtype="<u4"))
    event = blocks_stored([record], 16, "CPU")
    start = event.index(b"token_ids") + len(b"token_ids")
    header_bytes = 1 if len(tokens) < 16 else 3
    return event[start : start + header_bytes + 5 * len(tokens)]


@given(token_lists, st.booleans())
def test_token_arrays_read_any_encoding_of_the_ids(lists: list[list[int]], as_kvstore_writes: bool) -> None:
    """kvstore's ``uint 32`` items (one numpy pass when the shapes agree) and a generic encoder's smallest ints
    (read through msgspec) decode to the same ids."""
    raws = [msgspec.Raw(kvstore_items(tokens) if as_kvstore_writes else msgpack.packb(tokens)) for tokens in lists]
    arrays = token_arrays(raws)
    assert [array.tolist() for array in arrays] == lists
    assert all(array.dtype == np.uint32 for array in arrays)


def test_a_mirror_keeps_each_stored_blocks_fields_and_drops_removed_ones() -> None:
    keys = [PrefixKey(bytes([index]) * 16) for index in range(1, 5)]
    records = [
        ChunkRecord(key=key, source_start=16 * index, tokens=np.arange(16 * index, 16 * index + 16, dtype="<u4"),
                    parent_key=keys[index - 1] if index else None)
        for index, key in enumerate(keys)
    ]  # fmt: skip
    mirror = ResidencyMirror()
    mirror.apply(0, batch(1.0, [blocks_stored(records, 16, "CPU"), block_removed(keys[:1], "CPU")], 5))
    assert mirror.resident == {("CPU", key) for key in keys[1:]} and mirror.last_seq == 0
    block = mirror.stored[keys[2]]
    assert isinstance(block, StoredBlock) and block.parent_block_hash == keys[1] and block.block_size == 16
    assert block.token_ids.tolist() == list(range(32, 48))


def test_a_mirror_splits_an_event_of_several_blocks_into_one_per_block() -> None:
    """vLLM's engines send one ``BlockStored`` for a run of blocks, its token ids all the blocks' in order: each
    block gets its own slice, and its parent is the block before it."""
    hashes = [b"a" * 16, b"b" * 16, b"c" * 16]
    event = BlockStored(block_hashes=list(hashes), parent_block_hash=b"p" * 16,
                        token_ids=msgspec.Raw(msgpack.packb(list(range(12)))), block_size=4, medium="GPU")  # fmt: skip
    mirror = ResidencyMirror()
    mirror.apply(7, msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=[event])))
    assert mirror.resident == {("GPU", block_hash) for block_hash in hashes} and mirror.last_seq == 7
    assert [mirror.stored[block_hash].token_ids.tolist() for block_hash in hashes] == [[0, 1, 2, 3], [4, 5, 6, 7],
                                                                                      [8, 9, 10, 11]]  # fmt: skip
    assert [mirror.stored[block_hash].parent_block_hash for block_hash in hashes] == [b"p" * 16, *hashes[:2]]
