"""The meta checksum of many records at once: xxh3_64 (seed 0) of each meta value without its checksum field.

A meta value is sealed with ``xxh3_64(value[0:48] + value[56:])`` (format). Opening a data dir checks every
record, a million for a million chunks; one ``xxhash`` call per record pays Python's call cost each time, so these numba
kernels hash a whole batch of records in one call, reading each record where it lies (no copy, the 8 checksum bytes
skipped in place). ``tests/tiers/disk/test_meta_checksum.py`` checks them against ``xxhash`` for every length the meta
format allows and for random records.

The algorithm is XXH3-64 with the default secret as the reference implementation (xxhash 0.8) writes it: inputs of
17-128 bytes mix 16-byte pairs from both ends, 129-240 bytes mix every 16 bytes, longer ones accumulate 64-byte
stripes in eight 64-bit lanes, scrambled every 1024 bytes, then merge the lanes. The 128-bit multiply is built
from 32-bit halves. Records are read as little-endian ``u32`` words: a meta value's size is a multiple of 4 and
every record starts on a 4-byte boundary of the batch (``meta_batch`` checks both before calling).

Pure functions; the kernels release the GIL.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit, types, void

__all__ = ["meta_digests"]

_SECRET = np.frombuffer(
    bytes.fromhex(
        "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
        "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
        "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
        "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
        "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
        "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
    ),
    dtype=np.uint8,
)
_SECRET_WORDS = _SECRET.view("<u8").copy()  # the secret as 24 words (stripe keys and the scramble key)
_LAST_STRIPE_KEYS = np.array(  # secret[121 + 8i]: the last stripe's keys (unaligned in the secret)
    [int.from_bytes(_SECRET[121 + 8 * i : 129 + 8 * i].tobytes(), "little") for i in range(8)], dtype=np.uint64
)
_CHECKSUM_WORD = 12  # the checksum field is bytes [48, 56): words 12 and 13
_MAX_SHORT_BYTES = 240  # inputs up to this many bytes take the short paths

_U = np.uint64
_PRIME32_1, _PRIME32_2, _PRIME32_3 = _U(0x9E3779B1), _U(0x85EBCA77), _U(0xC2B2AE3D)
_PRIME64_1, _PRIME64_2, _PRIME64_3 = _U(0x9E3779B185EBCA87), _U(0xC2B2AE3D27D4EB4F), _U(0x165667B19E3779F9)
_PRIME64_4, _PRIME64_5 = _U(0x85EBCA77C2B2AE63), _U(0x27D4EB2F165667C5)
_PRIME_MX1 = _U(0x165667919E3779F9)
_LOW32 = _U(0xFFFFFFFF)
_S32, _S47 = _U(32), _U(47)


# fmt: off
@njit(cache=True, nogil=True, inline="always")
def _word64(words, byte_offset):  # type: ignore[no-untyped-def]
    """The little-endian u64 at a 4-aligned byte offset of a u32 array."""
    index = byte_offset >> 2
    return _U(words[index]) | (_U(words[index + 1]) << _S32)


@njit(cache=True, nogil=True, inline="always")
def _secret64(offset):  # type: ignore[no-untyped-def]
    value = _U(0)
    for byte in range(8):
        value |= _U(_SECRET[offset + byte]) << _U(8 * byte)
    return value


@njit(cache=True, nogil=True, inline="always")
def _mul128_fold64(left, right):  # type: ignore[no-untyped-def]
    """Low 64 bits xor high 64 bits of the 128-bit product."""
    left_low, left_high, right_low, right_high = left & _LOW32, left >> _S32, right & _LOW32, right >> _S32
    low_low, high_low = left_low * right_low, left_high * right_low
    low_high, high_high = left_low * right_high, left_high * right_high
    cross = (low_low >> _S32) + (high_low & _LOW32) + low_high
    upper = (high_low >> _S32) + (cross >> _S32) + high_high
    lower = (cross << _S32) | (low_low & _LOW32)
    return lower ^ upper


@njit(cache=True, nogil=True, inline="always")
def _avalanche(value):  # type: ignore[no-untyped-def]
    value ^= value >> _U(37)
    value *= _PRIME_MX1
    return value ^ (value >> _S32)


@njit(cache=True, nogil=True, inline="always")
def _mix16(words, byte_offset, secret_offset):  # type: ignore[no-untyped-def]
    return _mul128_fold64(
        _word64(words, byte_offset) ^ _secret64(secret_offset),
        _word64(words, byte_offset + 8) ^ _secret64(secret_offset + 8),
    )


@njit(cache=True, nogil=True)
def _short_digest(words, length):  # type: ignore[no-untyped-def]
    """XXH3-64 of ``length`` (17..240, a multiple of 4) bytes held from word 0 of ``words``."""
    accumulator = _U(length) * _PRIME64_1
    if length <= 128:
        if length > 32:
            if length > 64:
                if length > 96:
                    accumulator += _mix16(words, 48, 96) + _mix16(words, length - 64, 112)
                accumulator += _mix16(words, 32, 64) + _mix16(words, length - 48, 80)
            accumulator += _mix16(words, 16, 32) + _mix16(words, length - 32, 48)
        accumulator += _mix16(words, 0, 0) + _mix16(words, length - 16, 16)
        return _avalanche(accumulator)
    for round_idx in range(8):
        accumulator += _mix16(words, 16 * round_idx, 16 * round_idx)
    accumulator = _avalanche(accumulator)
    for round_idx in range(8, length // 16):
        accumulator += _mix16(words, 16 * round_idx, 16 * (round_idx - 8) + 3)
    accumulator += _mix16(words, length - 16, 136 - 17)
    return _avalanche(accumulator)


@njit(cache=True, nogil=True)
def _long_digest(words, start, length, stripe_keys, last_keys):  # type: ignore[no-untyped-def]
    """XXH3-64 of a record's ``length`` (> 240) bytes without its checksum field: the record's byte ``x`` is input
    byte ``x`` below 48 and input byte ``x - 8`` from 56 on. ``start``: the record's first byte in ``words``."""
    lane0, lane1, lane2, lane3 = _PRIME32_3, _PRIME64_1, _PRIME64_2, _PRIME64_3
    lane4, lane5, lane6, lane7 = _PRIME64_4, _PRIME32_2, _PRIME64_5, _PRIME32_1
    num_blocks = (length - 1) // 1024
    num_stripes = 16 * num_blocks + ((length - 1) - 1024 * num_blocks) // 64
    for stripe in range(num_stripes + 1):  # the last one is the input's final 64 bytes, with its own keys
        if stripe == 0:  # input bytes [0, 64): record bytes [0, 48) and [56, 72)
            at = start
            value6, value7 = _word64(words, at + 56), _word64(words, at + 64)
        else:
            at = start + 8 + (64 * stripe if stripe < num_stripes else length - 64)
            value6, value7 = _word64(words, at + 48), _word64(words, at + 56)
        value0, value1, value2, value3 = (_word64(words, at), _word64(words, at + 8), _word64(words, at + 16),
                                          _word64(words, at + 24))
        value4, value5 = _word64(words, at + 32), _word64(words, at + 40)
        if stripe < num_stripes:
            key_idx = stripe % 16
            key0, key1, key2, key3 = (stripe_keys[key_idx], stripe_keys[key_idx + 1], stripe_keys[key_idx + 2],
                                      stripe_keys[key_idx + 3])
            key4, key5, key6, key7 = (stripe_keys[key_idx + 4], stripe_keys[key_idx + 5], stripe_keys[key_idx + 6],
                                      stripe_keys[key_idx + 7])
        else:
            key0, key1, key2, key3 = last_keys[0], last_keys[1], last_keys[2], last_keys[3]
            key4, key5, key6, key7 = last_keys[4], last_keys[5], last_keys[6], last_keys[7]
        key0 ^= value0
        key1 ^= value1
        key2 ^= value2
        key3 ^= value3
        key4 ^= value4
        key5 ^= value5
        key6 ^= value6
        key7 ^= value7
        lane0 += value1 + (key0 & _LOW32) * (key0 >> _S32)
        lane1 += value0 + (key1 & _LOW32) * (key1 >> _S32)
        lane2 += value3 + (key2 & _LOW32) * (key2 >> _S32)
        lane3 += value2 + (key3 & _LOW32) * (key3 >> _S32)
        lane4 += value5 + (key4 & _LOW32) * (key4 >> _S32)
        lane5 += value4 + (key5 & _LOW32) * (key5 >> _S32)
        lane6 += value7 + (key6 & _LOW32) * (key6 >> _S32)
        lane7 += value6 + (key7 & _LOW32) * (key7 >> _S32)
        if stripe < num_stripes and stripe % 16 == 15:  # the end of a 1024-byte block: scramble
            lane0 = ((lane0 ^ (lane0 >> _S47)) ^ stripe_keys[16]) * _PRIME32_1
            lane1 = ((lane1 ^ (lane1 >> _S47)) ^ stripe_keys[17]) * _PRIME32_1
            lane2 = ((lane2 ^ (lane2 >> _S47)) ^ stripe_keys[18]) * _PRIME32_1
            lane3 = ((lane3 ^ (lane3 >> _S47)) ^ stripe_keys[19]) * _PRIME32_1
            lane4 = ((lane4 ^ (lane4 >> _S47)) ^ stripe_keys[20]) * _PRIME32_1
            lane5 = ((lane5 ^ (lane5 >> _S47)) ^ stripe_keys[21]) * _PRIME32_1
            lane6 = ((lane6 ^ (lane6 >> _S47)) ^ stripe_keys[22]) * _PRIME32_1
            lane7 = ((lane7 ^ (lane7 >> _S47)) ^ stripe_keys[23]) * _PRIME32_1
    result = _U(length) * _PRIME64_1
    result += _mul128_fold64(lane0 ^ _secret64(11), lane1 ^ _secret64(19))
    result += _mul128_fold64(lane2 ^ _secret64(27), lane3 ^ _secret64(35))
    result += _mul128_fold64(lane4 ^ _secret64(43), lane5 ^ _secret64(51))
    result += _mul128_fold64(lane6 ^ _secret64(59), lane7 ^ _secret64(67))
    return _avalanche(result)


_WORDS = types.Array(types.uint32, 1, "C", readonly=True)
_POSITIONS = types.Array(types.int64, 1, "C", readonly=True)
_KEYS = types.Array(types.uint64, 1, "C", readonly=True)
_DIGESTS = types.Array(types.uint64, 1, "C")


@njit(void(_WORDS, _POSITIONS, _POSITIONS, _KEYS, _KEYS, _DIGESTS), cache=True, nogil=True)
def _digests_kernel(words, starts, sizes, stripe_keys, last_keys, digests):  # type: ignore[no-untyped-def]
    short_input = np.empty(_MAX_SHORT_BYTES // 4, dtype=np.uint32)
    for record in range(starts.shape[0]):
        start, length = starts[record], sizes[record] - 8
        if length > _MAX_SHORT_BYTES:
            digests[record] = _long_digest(words, start, length, stripe_keys, last_keys)
            continue
        first_word = start >> 2  # copy the record's words but the checksum's two, then hash the copy
        for word in range(_CHECKSUM_WORD):
            short_input[word] = words[first_word + word]
        for word in range(_CHECKSUM_WORD, length >> 2):
            short_input[word] = words[first_word + word + 2]
        digests[record] = _short_digest(short_input, length)
# fmt: on


def meta_digests(
    words: npt.NDArray[np.uint32], starts: npt.NDArray[np.int64], sizes: npt.NDArray[np.int64]
) -> npt.NDArray[np.uint64]:
    """The xxh3_64 of each record's bytes but its checksum field (``[0, 48) + [56, size)``).

    Args:
        words: the records' bytes as little-endian u32 words.
        starts: each record's first byte in ``words`` (a multiple of 4).
        sizes: each record's bytes (a multiple of 4, at least 56: the fixed part of a meta value).

    Returns:
        One digest per record: the value its checksum field must hold.
    """
    starts = np.ascontiguousarray(starts, dtype=np.int64)
    sizes = np.ascontiguousarray(sizes, dtype=np.int64)
    assert starts.shape == sizes.shape, "meta_digests: one start per size (meta_batch wiring)"
    if starts.size:
        ends = starts + sizes
        assert not (starts % 4).any() and not (sizes % 4).any() and int(sizes.min()) >= 56, (
            "meta_digests needs 4-aligned records of 56 bytes or more: meta_batch must filter the others out"
        )
        assert int(starts.min()) >= 0 and int(ends.max()) <= 4 * words.shape[0], "meta_digests: a record past words"
    digests = np.empty(starts.shape[0], dtype=np.uint64)
    _digests_kernel(words, starts, sizes, _SECRET_WORDS, _LAST_STRIPE_KEYS, digests)
    return digests
