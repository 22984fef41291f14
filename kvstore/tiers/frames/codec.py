"""Payload codec for one frame of KV bytes: byte-plane shuffle, zstd per plane, a checksum over everything.

Float KV compresses only in its high bytes (sign and exponent); the low mantissa bytes are noise. So a frame
is split into *byte planes* (plane ``p`` holds byte ``p`` of every element, little-endian), each plane is
compressed on its own and kept compressed only when that pays (below ``keep_ratio`` of the plane), and the
incompressible planes are stored raw. On random bf16 the high plane compresses and the low plane does not at all
(measured: docs/design-notes.md#tiers-frames-codec), so a frame costs one zstd pass over half of its bytes (a
64 KiB probe rejects the low plane early).

Stored value layout (little-endian)::

    offset        size  field
    0             4     magic b"KVF\\x01"
    4             1     format version (1)
    5             1     element size E in bytes = number of planes (1..8)
    6             2     reserved, zero
    8             8     raw bytes of the frame (u64)
    16            8     xxh3_64 of bytes [0, 16) followed by [24, end): everything but this field
    24            8*E   plane table in stored order (plane E-1 first), one entry per plane:
                          u8 codec (0 raw, 1 zstd), 3 bytes reserved, u32 stored bytes
    24+8E         ...   plane E-1 | plane E-2 | ... | plane 0 | tail
                        each plane holds raw_bytes // E bytes before compression; the tail holds the last
                        raw_bytes % E bytes, raw (frames whose length E does not divide)

``decode_into`` checks magic, version, every length and the checksum *before* decompressing, and reports any
defect as a ``FrameStatus`` value (a corrupt frame is a miss, never an exception and never wrong data). A
stored value is never larger than ``header_bytes + raw_bytes`` because compressed planes are kept only when
smaller.

Threads: ``FrameCodec`` is safe to share. zstd contexts are not thread-safe, so each thread gets its own
compressor, decompressor and scratch buffer through a ``threading.local`` owned by the codec; the numba
kernels and zstd release the GIL, so frames encode and decode in parallel on a thread pool.
"""

from __future__ import annotations

import enum
import logging
import struct
import threading

import numpy as np
import numpy.typing as npt
import xxhash
import zstandard
from numba import njit, types, void

from kvstore.errors import ConfigError

__all__ = ["FRAME_FORMAT_VERSION", "FrameCodec", "FrameSource", "FrameStatus"]

logger = logging.getLogger(__name__)

FRAME_FORMAT_VERSION = 1
_MAGIC = b"KVF\x01"
_HEADER = struct.Struct("<4sBBHQQ")  # magic, version, element size, reserved, raw bytes, checksum
_PLANE_ENTRY = struct.Struct("<B3xI")  # codec, stored bytes
_CHECKSUM_OFFSET = 16
_CHECKSUM_END = 24
_CODEC_RAW = 0
_CODEC_ZSTD = 1
_MAX_ELEMENT_SIZE = 8
_MAX_PLANE_BYTES = 2**32 - 1
_MIN_COMPRESS_BYTES = 256  # below this zstd's own header eats the gain
_PROBE_BYTES = 64 * 1024  # compress this much of a plane first and give up early when it does not pay

FrameSource = bytes | bytearray | memoryview | npt.NDArray[np.uint8]
"""Raw or encoded bytes: anything with a contiguous buffer, or a 1-D uint8 numpy array."""

_READ = types.Array(types.uint8, 1, "C", readonly=True)
_WRITE = types.Array(types.uint8, 1, "C")


@njit(void(_READ, types.intp, _WRITE), cache=True, nogil=True)
def _split_planes(src: npt.NDArray[np.uint8], element_size: int, planes: npt.NDArray[np.uint8]) -> None:
    """Write plane ``p`` of ``src`` to ``planes[(E-1-p)*n : (E-p)*n]`` (most significant byte first)."""
    n = src.shape[0] // element_size
    if element_size == 2:
        for i in range(n):
            planes[i] = src[2 * i + 1]
            planes[n + i] = src[2 * i]
    elif element_size == 4:
        for i in range(n):
            planes[i] = src[4 * i + 3]
            planes[n + i] = src[4 * i + 2]
            planes[2 * n + i] = src[4 * i + 1]
            planes[3 * n + i] = src[4 * i]
    else:
        for p in range(element_size):
            base = (element_size - 1 - p) * n
            for i in range(n):
                planes[base + i] = src[i * element_size + p]


@njit(void(_WRITE, _READ, _READ), cache=True, nogil=True)
def _merge_planes_2(dst: npt.NDArray[np.uint8], plane1: npt.NDArray[np.uint8], plane0: npt.NDArray[np.uint8]) -> None:
    for i in range(plane1.shape[0]):
        dst[2 * i] = plane0[i]
        dst[2 * i + 1] = plane1[i]


@njit(void(_WRITE, _READ, _READ, _READ, _READ), cache=True, nogil=True)
def _merge_planes_4(
    dst: npt.NDArray[np.uint8],
    plane3: npt.NDArray[np.uint8],
    plane2: npt.NDArray[np.uint8],
    plane1: npt.NDArray[np.uint8],
    plane0: npt.NDArray[np.uint8],
) -> None:
    for i in range(plane3.shape[0]):
        dst[4 * i] = plane0[i]
        dst[4 * i + 1] = plane1[i]
        dst[4 * i + 2] = plane2[i]
        dst[4 * i + 3] = plane3[i]


@njit(void(_WRITE, _READ, types.intp, types.intp), cache=True, nogil=True)
def _merge_one_plane(
    dst: npt.NDArray[np.uint8], plane: npt.NDArray[np.uint8], byte_idx: int, element_size: int
) -> None:
    for i in range(plane.shape[0]):
        dst[i * element_size + byte_idx] = plane[i]


class FrameStatus(enum.StrEnum):
    """Outcome of ``FrameCodec.decode_into``; everything but ``OK`` means the frame is corrupt (a miss)."""

    OK = "ok"
    TRUNCATED = "truncated"
    BAD_MAGIC = "bad magic"
    UNSUPPORTED_VERSION = "unsupported format version"
    BAD_HEADER = "inconsistent header"
    BAD_CHECKSUM = "checksum mismatch"
    SIZE_MISMATCH = "raw size differs from the destination"
    BAD_PAYLOAD = "zstd payload does not decompress"


def _as_bytes_array(data: FrameSource) -> npt.NDArray[np.uint8]:
    """A 1-D uint8 view of ``data`` without copying."""
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8 or data.ndim != 1 or not data.flags.c_contiguous:
            raise ConfigError(
                f"frame bytes must be a contiguous 1-D uint8 array, got dtype {data.dtype} shape {data.shape}"
            )
        return data
    return np.frombuffer(data, dtype=np.uint8)


class _ThreadState:
    """One thread's zstd contexts and scratch planes (zstd contexts must not be shared between threads)."""

    __slots__ = ("compressor", "decompressor", "scratch")

    def __init__(self, params: zstandard.ZstdCompressionParameters) -> None:
        self.compressor = zstandard.ZstdCompressor(compression_params=params)
        self.decompressor = zstandard.ZstdDecompressor()
        self.scratch: npt.NDArray[np.uint8] = np.empty(0, dtype=np.uint8)

    def scratch_of(self, num_bytes: int) -> npt.NDArray[np.uint8]:
        if self.scratch.shape[0] < num_bytes:
            self.scratch = np.empty(num_bytes, dtype=np.uint8)
        return self.scratch[:num_bytes]


class FrameCodec:
    """Encode and decode frames of one element size (2 for fp16/bf16, 4 for fp32, 1 for fp8 KV and plain bytes).

    A 1-byte element is one plane: the frame is zstd'd (or kept raw) as it is, with no shuffle, so fp8 KV comes back
    byte for byte whatever its values (NaN codes included).

    Args:
        element_size_bytes: bytes per element; the number of byte planes (1..8).
        zstd_level: zstd level for the planes. The codec keeps the level's strategy but uses a 64-entry hash
            table and 7-byte minimum matches: byte planes of floats are close to i.i.d. symbols, so zstd's
            gain is its entropy coding and short matches only cost time: on random bf16 both the ratio and the
            speed went up (measured: docs/design-notes.md#tiers-frames-codec).
        keep_ratio: keep a compressed plane only when it is smaller than this fraction of the raw plane.
    """

    def __init__(self, element_size_bytes: int, *, zstd_level: int = 1, keep_ratio: float = 0.9) -> None:
        if not 1 <= element_size_bytes <= _MAX_ELEMENT_SIZE:
            raise ConfigError(
                f"element_size_bytes={element_size_bytes} is not supported; use 1..{_MAX_ELEMENT_SIZE} "
                "(2 for float16/bfloat16, 4 for float32)"
            )
        if not 0.0 < keep_ratio <= 1.0:
            raise ConfigError(f"keep_ratio={keep_ratio} must lie in (0, 1], e.g. 0.9")
        try:
            self._params = zstandard.ZstdCompressionParameters.from_level(zstd_level, hash_log=6, min_match=7)
        except zstandard.ZstdError as exc:
            raise ConfigError(f"zstd_level={zstd_level} is not a valid zstd level (use 1..19): {exc}") from exc
        self._element_size = element_size_bytes
        self._zstd_level = zstd_level
        self._keep_ratio = keep_ratio
        self._header_bytes = _HEADER.size + _PLANE_ENTRY.size * element_size_bytes
        self._local = threading.local()

    @property
    def element_size_bytes(self) -> int:
        return self._element_size

    @property
    def zstd_level(self) -> int:
        return self._zstd_level

    @property
    def header_bytes(self) -> int:
        """Fixed bytes every stored value carries besides its planes."""
        return self._header_bytes

    def max_encoded_bytes(self, raw_bytes: int) -> int:
        """Most stored bytes a frame of ``raw_bytes`` can take (planes are never stored larger than raw)."""
        return self._header_bytes + raw_bytes

    def encode(self, src: FrameSource) -> bytes:
        """Encode one frame into a new ``bytes`` (convenience; the disk writer uses ``encode_into``)."""
        data = _as_bytes_array(src)
        out = np.empty(self.max_encoded_bytes(data.shape[0]), dtype=np.uint8)
        return out[: self.encode_into(data, out)].tobytes()

    def encode_into(self, src: FrameSource, out: npt.NDArray[np.uint8]) -> int:
        """Encode one frame into a caller's buffer.

        Args:
            src: the frame's raw bytes (any length, 0 included).
            out: writable uint8 buffer of at least ``max_encoded_bytes(len(src))`` bytes.

        Returns:
            Bytes of ``out`` the stored value occupies (from offset 0).

        Raises:
            ConfigError: ``out`` is too small or a plane would exceed 4 GiB (split the data into frames).
        """
        data = _as_bytes_array(src)
        raw_bytes = int(data.shape[0])
        if out.shape[0] < self.max_encoded_bytes(raw_bytes):
            raise ConfigError(
                f"encode buffer holds {out.shape[0]} bytes but a {raw_bytes}-byte frame needs up to "
                f"{self.max_encoded_bytes(raw_bytes)}; size it with FrameCodec.max_encoded_bytes"
            )
        element_size = self._element_size
        plane_bytes = raw_bytes // element_size
        if plane_bytes > _MAX_PLANE_BYTES:
            raise ConfigError(f"frame of {raw_bytes} bytes is too large for one frame; split it into frames")
        state = self._state()
        if element_size == 1:
            planes = data
        else:
            planes = state.scratch_of(plane_bytes * element_size)
            _split_planes(data[: plane_bytes * element_size], element_size, planes)
        offset = self._header_bytes
        for stored_idx in range(element_size):
            plane = planes[stored_idx * plane_bytes : (stored_idx + 1) * plane_bytes]
            compressed = self._compress_if_it_pays(state, plane)
            if compressed is None:
                out[offset : offset + plane_bytes] = plane
                codec, stored_bytes = _CODEC_RAW, plane_bytes
            else:
                stored_bytes = len(compressed)
                out[offset : offset + stored_bytes] = np.frombuffer(compressed, dtype=np.uint8)
                codec = _CODEC_ZSTD
            _PLANE_ENTRY.pack_into(out.data, _HEADER.size + stored_idx * _PLANE_ENTRY.size, codec, stored_bytes)
            offset += stored_bytes
        tail_bytes = raw_bytes - plane_bytes * element_size
        out[offset : offset + tail_bytes] = data[raw_bytes - tail_bytes :]
        offset += tail_bytes
        _HEADER.pack_into(out.data, 0, _MAGIC, FRAME_FORMAT_VERSION, element_size, 0, raw_bytes, 0)
        view = out.data
        _HEADER.pack_into(
            out.data, 0, _MAGIC, FRAME_FORMAT_VERSION, element_size, 0, raw_bytes, _checksum(view, offset)
        )
        return offset

    def decode_into(self, value: FrameSource, dst: npt.NDArray[np.uint8]) -> FrameStatus:
        """Verify a stored value and decode it into ``dst``.

        Raw planes are merged straight from ``value`` (a memoryview into LMDB's map is fine: nothing is copied
        first); compressed planes are decompressed into this thread's scratch buffer, then merged.

        Args:
            value: the stored value.
            dst: writable, contiguous uint8 buffer of exactly the frame's raw size.

        Returns:
            ``FrameStatus.OK``, or the first defect found. ``dst`` may be partly written when a zstd payload
            fails to decompress; its contents are then undefined.
        """
        source = _as_bytes_array(value)
        view = source.data
        total_bytes = source.shape[0]
        if total_bytes < _HEADER.size:
            return FrameStatus.TRUNCATED
        magic, version, element_size, _, raw_bytes, checksum = _HEADER.unpack_from(view, 0)
        if magic != _MAGIC:
            return FrameStatus.BAD_MAGIC
        if version != FRAME_FORMAT_VERSION:
            return FrameStatus.UNSUPPORTED_VERSION
        if element_size != self._element_size:
            return FrameStatus.BAD_HEADER
        if total_bytes < self._header_bytes:
            return FrameStatus.TRUNCATED
        plane_bytes = raw_bytes // element_size
        entries: list[tuple[int, int]] = []
        expected_bytes = self._header_bytes + raw_bytes - plane_bytes * element_size
        for stored_idx in range(element_size):
            codec, stored_bytes = _PLANE_ENTRY.unpack_from(view, _HEADER.size + stored_idx * _PLANE_ENTRY.size)
            if not (
                (codec == _CODEC_RAW and stored_bytes == plane_bytes)
                or (codec == _CODEC_ZSTD and 0 < stored_bytes < plane_bytes)
            ):
                return FrameStatus.BAD_HEADER
            entries.append((codec, stored_bytes))
            expected_bytes += stored_bytes
        if expected_bytes != total_bytes:
            return FrameStatus.TRUNCATED if expected_bytes > total_bytes else FrameStatus.BAD_HEADER
        if _checksum(view, total_bytes) != checksum:
            return FrameStatus.BAD_CHECKSUM
        if raw_bytes != dst.shape[0]:
            return FrameStatus.SIZE_MISMATCH
        return self._decode_planes(source, entries, plane_bytes, dst)

    def _decode_planes(
        self,
        source: npt.NDArray[np.uint8],
        entries: list[tuple[int, int]],
        plane_bytes: int,
        dst: npt.NDArray[np.uint8],
    ) -> FrameStatus:
        element_size = self._element_size
        state = self._state()
        scratch = state.scratch_of(plane_bytes * element_size)
        planes: list[npt.NDArray[np.uint8]] = []
        offset = self._header_bytes
        for stored_idx, (codec, stored_bytes) in enumerate(entries):
            payload = source[offset : offset + stored_bytes]
            offset += stored_bytes
            if codec == _CODEC_RAW:
                planes.append(payload)
                continue
            target = dst if element_size == 1 else scratch[stored_idx * plane_bytes : (stored_idx + 1) * plane_bytes]
            if not _decompress_into(state.decompressor, payload, target):
                return FrameStatus.BAD_PAYLOAD
            planes.append(target)
        if element_size == 1:
            if entries[0][0] == _CODEC_RAW:
                dst[:] = planes[0]
        elif element_size == 2:
            _merge_planes_2(dst, planes[0], planes[1])
        elif element_size == 4:
            _merge_planes_4(dst, planes[0], planes[1], planes[2], planes[3])
        else:
            for stored_idx, plane in enumerate(planes):
                _merge_one_plane(dst, plane, element_size - 1 - stored_idx, element_size)
        tail_bytes = dst.shape[0] - plane_bytes * element_size
        dst[dst.shape[0] - tail_bytes :] = source[offset : offset + tail_bytes]
        return FrameStatus.OK

    def _state(self) -> _ThreadState:
        state: _ThreadState | None = getattr(self._local, "state", None)
        if state is None:
            state = _ThreadState(self._params)
            self._local.state = state
        return state

    def _compress_if_it_pays(self, state: _ThreadState, plane: npt.NDArray[np.uint8]) -> bytes | None:
        plane_bytes = plane.shape[0]
        if plane_bytes < _MIN_COMPRESS_BYTES:
            return None
        if plane_bytes >= 4 * _PROBE_BYTES:
            probe = state.compressor.compress(plane[:_PROBE_BYTES].data)
            if len(probe) >= self._keep_ratio * _PROBE_BYTES:
                return None
        compressed = state.compressor.compress(plane.data)
        return compressed if len(compressed) < self._keep_ratio * plane_bytes else None


def _checksum(view: memoryview, end: int) -> int:
    """xxh3_64 of the value up to ``end``, skipping the checksum field itself."""
    hasher = xxhash.xxh3_64()
    hasher.update(view[:_CHECKSUM_OFFSET])
    hasher.update(view[_CHECKSUM_END:end])
    return hasher.intdigest()


def _decompress_into(
    decompressor: zstandard.ZstdDecompressor, payload: npt.NDArray[np.uint8], target: npt.NDArray[np.uint8]
) -> bool:
    """Decompress one zstd frame into ``target``; ``False`` unless it yields exactly ``len(target)`` bytes."""
    filled = 0
    want = target.shape[0]
    out = target.data
    try:
        with decompressor.stream_reader(payload.data, closefd=False) as reader:
            while filled < want:
                got = reader.readinto(out[filled:])
                if got == 0:
                    return False
                filled += got
            return reader.read(1) == b""
    except zstandard.ZstdError:
        return False
