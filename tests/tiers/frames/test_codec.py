"""FrameCodec: every element size and length round-trips, corruption is always detected, compression pays."""

from __future__ import annotations

import threading

import numpy as np
import numpy.typing as npt
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.errors import ConfigError
from kvstore.tiers.frames.codec import FrameCodec, FrameStatus

ELEMENT_SIZES = [1, 2, 3, 4, 8]
CODECS = {size: FrameCodec(size) for size in ELEMENT_SIZES}

codec_settings = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make_bytes(kind: str, num_bytes: int, seed: int) -> npt.NDArray[np.uint8]:
    """Test data of one of several shapes: noise, runs, a tiny alphabet, or float KV."""
    rng = np.random.default_rng(seed)
    if kind == "random":
        return rng.integers(0, 256, num_bytes, dtype=np.uint8)
    if kind == "zeros":
        return np.zeros(num_bytes, dtype=np.uint8)
    if kind == "alphabet":
        return rng.choice(np.array([0, 7, 128, 255], dtype=np.uint8), num_bytes)
    values = rng.standard_normal(num_bytes // 2 + 1).astype(np.float32)
    bf16 = torch.from_numpy(values).to(torch.bfloat16).view(torch.uint8).numpy()
    return np.ascontiguousarray(bf16[:num_bytes])


def round_trip(codec: FrameCodec, raw: npt.NDArray[np.uint8]) -> tuple[bytes, npt.NDArray[np.uint8]]:
    encoded = codec.encode(raw)
    out = np.full(raw.shape[0], 0xA5, dtype=np.uint8)
    assert codec.decode_into(encoded, out) is FrameStatus.OK
    return encoded, out


@codec_settings
@given(
    element_size=st.sampled_from(ELEMENT_SIZES),
    kind=st.sampled_from(["random", "zeros", "alphabet", "bf16"]),
    num_bytes=st.one_of(st.integers(0, 64), st.integers(0, 20_000), st.integers(250_000, 300_001)),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_element_size_and_length_round_trips(element_size: int, kind: str, num_bytes: int, seed: int) -> None:
    codec = CODECS[element_size]
    raw = make_bytes(kind, num_bytes, seed)
    encoded, out = round_trip(codec, raw)
    np.testing.assert_array_equal(out, raw)
    assert len(encoded) <= codec.max_encoded_bytes(num_bytes)


@codec_settings
@given(element_size=st.sampled_from(ELEMENT_SIZES), data=st.binary(max_size=2_000))
def test_arbitrary_bytes_round_trip(element_size: int, data: bytes) -> None:
    _, out = round_trip(CODECS[element_size], np.frombuffer(data, dtype=np.uint8))
    assert out.tobytes() == data


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_float_kv_round_trips_bit_exact(dtype: torch.dtype) -> None:
    values = torch.randn(3, 2, 37, 5, generator=torch.Generator().manual_seed(1)).to(dtype)
    values[0, 0, 0, :3] = torch.tensor([float("nan"), float("inf"), -0.0], dtype=dtype)
    raw = values.view(torch.uint8).reshape(-1).numpy()
    codec = FrameCodec(values.element_size())
    _, out = round_trip(codec, raw)
    np.testing.assert_array_equal(out, raw)


@pytest.fixture(scope="module")
def encoded_bf16() -> tuple[FrameCodec, bytes, int]:
    """A small bf16 frame whose high plane is zstd-compressed and whose low plane is stored raw."""
    raw = make_bytes("bf16", 4_099, seed=3)
    codec = FrameCodec(2)
    return codec, codec.encode(raw), raw.shape[0]


@codec_settings
@given(position=st.integers(min_value=0), flip=st.integers(1, 255))
def test_any_flipped_byte_is_reported_corrupt(
    encoded_bf16: tuple[FrameCodec, bytes, int], position: int, flip: int
) -> None:
    codec, encoded, num_bytes = encoded_bf16
    damaged = bytearray(encoded)
    damaged[position % len(damaged)] ^= flip
    out = np.empty(num_bytes, dtype=np.uint8)
    assert codec.decode_into(bytes(damaged), out) is not FrameStatus.OK


def test_every_single_byte_flip_is_reported_corrupt(encoded_bf16: tuple[FrameCodec, bytes, int]) -> None:
    codec, encoded, num_bytes = encoded_bf16
    out = np.empty(num_bytes, dtype=np.uint8)
    for position in range(len(encoded)):
        damaged = bytearray(encoded)
        damaged[position] ^= 0x01
        assert codec.decode_into(damaged, out) is not FrameStatus.OK, f"flip at byte {position} went unnoticed"


@codec_settings
@given(keep=st.integers(min_value=0))
def test_truncated_or_extended_values_are_corrupt(encoded_bf16: tuple[FrameCodec, bytes, int], keep: int) -> None:
    codec, encoded, num_bytes = encoded_bf16
    out = np.empty(num_bytes, dtype=np.uint8)
    assert codec.decode_into(encoded[: keep % len(encoded)], out) is not FrameStatus.OK
    assert codec.decode_into(encoded + b"\x00" * (1 + keep % 9), out) is not FrameStatus.OK


def test_defects_are_named(encoded_bf16: tuple[FrameCodec, bytes, int]) -> None:
    codec, encoded, num_bytes = encoded_bf16
    out = np.empty(num_bytes, dtype=np.uint8)
    assert codec.decode_into(b"", out) is FrameStatus.TRUNCATED
    assert codec.decode_into(b"XXXX" + encoded[4:], out) is FrameStatus.BAD_MAGIC
    assert codec.decode_into(encoded[:4] + b"\x09" + encoded[5:], out) is FrameStatus.UNSUPPORTED_VERSION
    assert FrameCodec(4).decode_into(encoded, out) is FrameStatus.BAD_HEADER
    assert codec.decode_into(encoded, np.empty(num_bytes + 2, dtype=np.uint8)) is FrameStatus.SIZE_MISMATCH
    damaged = bytearray(encoded)
    damaged[-1] ^= 0xFF
    assert codec.decode_into(damaged, out) is FrameStatus.BAD_CHECKSUM


def test_bf16_kv_compresses() -> None:
    kv = torch.randn(32, 2, 64, 8, 128, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    raw = kv.view(torch.uint8).reshape(-1).numpy()
    codec = FrameCodec(2)
    encoded = codec.encode(raw)
    assert len(raw) / len(encoded) > 1.2
    _, out = round_trip(codec, raw)
    np.testing.assert_array_equal(out, raw)


def test_uniform_random_bytes_are_stored_raw() -> None:
    raw = make_bytes("random", 1_000_003, seed=5)
    for element_size in (1, 2, 4):
        codec = FrameCodec(element_size)
        assert len(codec.encode(raw)) == codec.header_bytes + raw.shape[0]


def test_encode_into_reuses_a_caller_buffer_and_checks_its_size() -> None:
    codec = FrameCodec(2)
    raw = make_bytes("bf16", 100_000, seed=6)
    out = np.zeros(codec.max_encoded_bytes(raw.shape[0]) + 10, dtype=np.uint8)
    length = codec.encode_into(raw, out)
    assert out[:length].tobytes() == codec.encode(raw)
    with pytest.raises(ConfigError, match="max_encoded_bytes"):
        codec.encode_into(raw, np.zeros(100, dtype=np.uint8))


def test_decode_reads_from_a_memoryview_window() -> None:
    codec = FrameCodec(2)
    raw = make_bytes("bf16", 50_000, seed=7)
    encoded = codec.encode(raw)
    window = memoryview(b"junk" + encoded + b"more")[4 : 4 + len(encoded)]
    out = np.empty(raw.shape[0], dtype=np.uint8)
    assert codec.decode_into(window, out) is FrameStatus.OK
    np.testing.assert_array_equal(out, raw)


def test_threads_share_one_codec() -> None:
    codec = FrameCodec(2)
    frames = [make_bytes("bf16", 200_000 + seed, seed) for seed in range(8)]
    failures: list[int] = []

    def work(thread_idx: int) -> None:
        for round_idx in range(5):
            raw = frames[(thread_idx + round_idx) % len(frames)]
            out = np.empty(raw.shape[0], dtype=np.uint8)
            if codec.decode_into(codec.encode(raw), out) is not FrameStatus.OK or not np.array_equal(out, raw):
                failures.append(thread_idx)

    threads = [threading.Thread(target=work, args=(idx,)) for idx in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


@pytest.mark.parametrize("bad", [{"element_size_bytes": 0}, {"element_size_bytes": 9}, {"keep_ratio": 0.0}])
def test_bad_settings_are_config_errors(bad: dict[str, float]) -> None:
    kwargs = {"element_size_bytes": 2, **bad}
    with pytest.raises(ConfigError):
        FrameCodec(int(kwargs.pop("element_size_bytes")), **kwargs)  # type: ignore[arg-type]
