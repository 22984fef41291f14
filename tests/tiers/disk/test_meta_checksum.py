"""meta_digests: the batched numba xxh3_64 equals xxhash's over each record without its checksum field."""

from __future__ import annotations

import numpy as np
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.tiers.disk.meta_checksum import meta_digests


def reference(record: bytes) -> int:
    return xxhash.xxh3_64_intdigest(record[:48] + record[56:])


def test_every_meta_length_up_to_three_blocks_at_every_word_offset() -> None:
    # 56..3400 bytes cover the 17-128, 129-240 and long paths (up to three 1024-byte blocks and their tails).
    data = np.random.default_rng(7).integers(0, 2**32, 2000, dtype=np.uint32)
    raw = data.tobytes()
    starts = [start for size in range(56, 3400, 4) for start in (0, 4, 12)]
    sizes = [size for size in range(56, 3400, 4) for _ in (0, 4, 12)]

    digests = meta_digests(data, np.array(starts), np.array(sizes))

    assert digests.tolist() == [reference(raw[start : start + size]) for start, size in zip(starts, sizes, strict=True)]


@settings(max_examples=60, deadline=None)
@given(
    records=st.lists(
        st.integers(14, 1200).flatmap(lambda words: st.binary(min_size=4 * words, max_size=4 * words)), max_size=8
    ),
)
def test_records_back_to_back_hash_as_each_alone(records: list[bytes]) -> None:
    joined = b"".join(records)
    sizes = np.array([len(record) for record in records], dtype=np.int64)
    starts = np.cumsum(sizes) - sizes

    digests = meta_digests(np.frombuffer(joined, dtype="<u4"), starts, sizes)

    assert digests.tolist() == [reference(record) for record in records]


def test_no_records_no_digests() -> None:
    assert meta_digests(np.zeros(4, dtype=np.uint32), np.zeros(0, np.int64), np.zeros(0, np.int64)).shape == (0,)
