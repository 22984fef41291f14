"""Chunk meta values: a batch decodes exactly as each record alone, whatever versions and defects it mixes."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.keys import PrefixKey, as_token_array
from kvstore.tiers.disk.meta_batch import decode_meta_batch
from kvstore.tiers.frames.meta import StoredChunk, decode_meta, decode_meta_values, encode_meta

FIELDS = [name for name in StoredChunk.__slots__ if name != "tokens"]


def stored_chunk(seed: int, num_tokens: int, *, with_parent: bool = True) -> StoredChunk:
    rng = np.random.default_rng(seed)
    return StoredChunk(
        key=PrefixKey(rng.bytes(16)),
        num_tokens=num_tokens,
        source_start=int(rng.integers(0, 2**40)),
        raw_bytes=num_tokens * 512,
        stored_bytes=num_tokens * 300,
        num_frames=1,
        frame_bytes=2**20,
        last_access_ns=int(rng.integers(0, 2**62)),
        tokens=as_token_array(rng.integers(0, 2**32 - 1, size=num_tokens)),
        parent_key=PrefixKey(rng.bytes(16)) if with_parent else None,
    )


def as_version_1(value: bytes) -> bytes:
    """The same record as a version 1 value (no parent key), resealed."""
    old = bytearray(value[:56]) + value[72:]
    struct.pack_into("<H", old, 0, 1)
    struct.pack_into("<Q", old, 48, xxhash.xxh3_64_intdigest(bytes(old[:48] + old[56:])))
    return bytes(old)


def same_chunk(got: StoredChunk | None, want: StoredChunk | None) -> bool:
    if got is None or want is None:
        return got is want
    return all(getattr(got, name) == getattr(want, name) for name in FIELDS) and np.array_equal(got.tokens, want.tokens)


# A record and how to spoil it: intact, as version 1, a flipped byte, cut short, one byte longer, unknown version.
DEFECTS = ["intact", "version_1", "flipped", "truncated", "one_more_byte", "version_9"]


def spoiled(chunk: StoredChunk, defect: str, position: int) -> bytes:
    value = encode_meta(chunk)
    if defect == "version_1":
        return as_version_1(value)
    if defect == "flipped":
        flipped = bytearray(value)
        flipped[position % len(value)] ^= 0x10
        return bytes(flipped)
    if defect == "truncated":
        return value[: position % len(value)]
    if defect == "one_more_byte":
        return value + b"\x00"
    if defect == "version_9":
        return struct.pack("<H", 9) + value[2:]
    return value


def test_a_decoded_chunk_equals_the_one_encoded_in_both_versions() -> None:
    chunk = stored_chunk(1, 5)
    assert same_chunk(decode_meta(chunk.key, encode_meta(chunk)), chunk)
    v1 = decode_meta(chunk.key, as_version_1(encode_meta(chunk)))
    assert v1 is not None and v1.parent_key is None and v1.tokens.tolist() == chunk.tokens.tolist()
    assert same_chunk(decode_meta(chunk.key, encode_meta(stored_chunk(1, 5, with_parent=False))), v1)
    sizes_only = decode_meta(chunk.key, encode_meta(chunk), with_tokens=False)
    assert sizes_only is not None and sizes_only.tokens.shape == (0,) and sizes_only.num_tokens == 5
    assert decode_meta(b"short", encode_meta(chunk)) is None


def test_decoded_chunks_are_frozen_like_constructed_ones() -> None:
    chunk = stored_chunk(2, 3)
    decoded = decode_meta(chunk.key, encode_meta(chunk))
    assert decoded is not None and type(decoded) is StoredChunk
    with pytest.raises(dataclasses.FrozenInstanceError):
        decoded.num_tokens = 4  # type: ignore[misc]
    assert same_chunk(dataclasses.replace(decoded), chunk)


@settings(max_examples=60, deadline=None)
@given(
    records=st.lists(
        st.tuples(st.integers(0, 2**32 - 1), st.integers(1, 40), st.sampled_from(DEFECTS), st.integers(0, 10**6)),
        min_size=1,
        max_size=12,
    ),
    with_tokens=st.booleans(),
    as_views=st.booleans(),
)
def test_a_batch_decodes_as_each_record_alone(
    records: list[tuple[int, int, str, int]], with_tokens: bool, as_views: bool
) -> None:
    chunks = [stored_chunk(seed, num_tokens) for seed, num_tokens, _, _ in records]
    values = [spoiled(chunk, defect, position) for chunk, (_, _, defect, position) in zip(chunks, records, strict=True)]
    keys = [chunk.key for chunk in chunks]
    batch_values: list[bytes | memoryview] = [memoryview(value) for value in values] if as_views else list(values)

    decoded = decode_meta_values(keys, batch_values, with_tokens=with_tokens)

    assert len(decoded) == len(values)
    for key, value, got, (_, _, defect, _) in zip(keys, values, decoded, records, strict=True):
        assert same_chunk(got, decode_meta(key, value, with_tokens=with_tokens))
        if defect in ("intact", "version_1"):
            assert got is not None  # the values after a misaligned one decode too
        if got is not None:
            assert got.tokens.dtype == np.dtype("<u4") and got.tokens.flags.c_contiguous
            assert got.tokens.shape == ((got.num_tokens,) if with_tokens else (0,))


def test_the_stored_checksum_is_xxh3_64_of_the_record_without_its_checksum_field() -> None:
    """The format's checksum, computed here from its definition (not through the decoder's code)."""
    value = encode_meta(stored_chunk(7, 33))
    stored = struct.unpack_from("<Q", value, 48)[0]
    assert stored == xxhash.xxh3_64_intdigest(value[:48] + value[56:])


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_tokens=st.integers(1, 40), position=st.integers(0, 10**6),
       bit=st.integers(0, 7))  # fmt: skip
def test_any_flipped_bit_of_a_meta_record_is_rejected_by_every_decoder(
    seed: int, num_tokens: int, position: int, bit: int
) -> None:
    chunk = stored_chunk(seed, num_tokens)
    flipped = bytearray(encode_meta(chunk))
    flipped[position % len(flipped)] ^= 1 << bit
    value = bytes(flipped)
    assert decode_meta(chunk.key, value) is None
    assert decode_meta_values([chunk.key], [value], with_tokens=True) == [None]
    batch = decode_meta_batch([chunk.key], [value])
    assert len(batch) == 0 and list(batch.broken_keys) == [chunk.key], "opening a data dir drops it too"
