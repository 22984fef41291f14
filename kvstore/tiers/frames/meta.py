"""The stored frame's chunk meta value: what the disk tier keeps in its ``meta`` sub-database and the remote
tier at the head of each value (one format, so a chunk moves between them without being re-encoded).

Chunk meta value (little-endian)::

    offset  size  field
    0       2     meta format version (1)
    2       2     reserved, zero
    4       4     num_tokens (u32)
    8       8     source_start (u64): position of the chunk's first token when its KV was computed
    16      8     raw bytes (u64): uncompressed KV bytes
    24      8     stored bytes (u64): the chunk's frames plus this meta value
    32      4     num_frames (u32)
    36      4     frame_bytes (u32): raw bytes per frame (the last frame may be shorter)
    40      8     last access (u64, ns since the epoch; persisted lazily)
    48      8     xxh3_64 of bytes [0, 48) followed by [56, end)
    56      16    parent key: the previous chunk of the same sequence (zeros for chunk 0; version 2 only)
    72      4*n   the chunk's tokens, <u4 (indexes such as content fingerprints are rebuilt from them)

Version 1 values (written before parent keys existed) lack the parent key: their tokens start at offset 56; they
are read as chunks without a known parent.

Pure functions and immutable values; thread-safe.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from kvstore.errors import ConfigError
from kvstore.keys import KEY_BYTES, PrefixKey, TokenArray
from kvstore.layout import KVLayout

__all__ = [
    "MAX_FRAMES_PER_CHUNK",
    "FrameGeometry",
    "StoredChunk",
    "balanced_frame_bytes",
    "decode_meta",
    "decode_meta_values",
    "encode_meta",
    "meta_bytes",
    "with_last_access",
]

MAX_FRAMES_PER_CHUNK = 2**16 - 1

_META_FORMAT_VERSION = 2
_META_V1 = 1
_META = struct.Struct("<HHIQQQIIQQ")
_NO_PARENT = bytes(KEY_BYTES)
_CHECKSUM_OFFSET = 48
_LAST_ACCESS = struct.Struct("<Q")
_LAST_ACCESS_OFFSET = 40
_TOKENS_OFFSETS = {_META_V1: _META.size, _META_FORMAT_VERSION: _META.size + KEY_BYTES}  # version -> tokens offset
_TOKEN_DTYPE = np.dtype("<u4")
_NO_TOKENS: TokenArray = np.frombuffer(b"", dtype=_TOKEN_DTYPE)  # read-only: one shared empty array is safe
_xxh3_64 = xxhash.xxh3_64


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredChunk:
    """One chunk as the data dir records it (``DiskTier.iter_records`` yields these for ``kvstore inspect``).

    Args:
        key: the chunk's prefix key.
        num_tokens: tokens in the chunk (the last chunk of a sequence may be partial).
        source_start: position of the first token when the KV was computed.
        raw_bytes: uncompressed KV bytes.
        stored_bytes: bytes the chunk occupies in LMDB values (frames plus meta; B-tree pages not counted).
        num_frames: codec frames the payload is split into.
        frame_bytes: raw bytes per frame (the last frame may be shorter).
        last_access_ns: last hit or write, ns since the epoch.
        tokens: the chunk's token ids.
        parent_key: the previous chunk of the same sequence, when known.
    """

    key: PrefixKey
    num_tokens: int
    source_start: int
    raw_bytes: int
    stored_bytes: int
    num_frames: int
    frame_bytes: int
    last_access_ns: int
    tokens: TokenArray
    parent_key: PrefixKey | None = None

    @property
    def compression_ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0


# The slots' setters, in field order (``_new_stored_chunk``).
_new_object = object.__new__
(
    _set_key,
    _set_num_tokens,
    _set_source_start,
    _set_raw_bytes,
    _set_stored_bytes,
    _set_num_frames,
    _set_frame_bytes,
    _set_last_access_ns,
    _set_tokens,
    _set_parent_key,
) = (getattr(StoredChunk, name).__set__ for name in StoredChunk.__slots__)


@dataclass(frozen=True, slots=True, kw_only=True)
class FrameGeometry:
    """How a layout's chunks are cut into frames, and the most bytes a chunk can take in LMDB.

    Args:
        layout: the KV layout.
        chunk_size: tokens per full chunk.
        frame_bytes: raw bytes per frame, a multiple of the element size (the last frame may be shorter).
        frame_header_bytes: fixed bytes of each encoded frame (``FrameCodec.header_bytes``).
    """

    layout: KVLayout
    chunk_size: int
    frame_bytes: int
    frame_header_bytes: int

    def __post_init__(self) -> None:
        element_size = self.layout.dtype.element_size_bytes
        if self.chunk_size <= 0:
            raise ConfigError(f"chunk_size={self.chunk_size} must be a positive number of tokens, e.g. 256")
        if not 0 < self.frame_bytes < 2**32 or self.frame_bytes % element_size:
            raise ConfigError(f"frame_bytes={self.frame_bytes} must be a positive multiple of {element_size}")
        if self.num_frames(self.layout.chunk_bytes(self.chunk_size)) > MAX_FRAMES_PER_CHUNK:
            raise ConfigError(f"frame_bytes={self.frame_bytes} cuts a chunk into too many frames; use 4MiB")

    def num_frames(self, raw_bytes: int) -> int:
        return -(-raw_bytes // self.frame_bytes)

    def stored_bound_bytes(self, num_tokens: int) -> int:
        """Most stored bytes a chunk of ``num_tokens`` can take (the codec never stores a plane enlarged)."""
        raw_bytes = self.layout.chunk_bytes(num_tokens)
        return raw_bytes + self.num_frames(raw_bytes) * self.frame_header_bytes + meta_bytes(num_tokens)


def meta_bytes(num_tokens: int, version: int = _META_FORMAT_VERSION) -> int:
    """Size of the meta value of a chunk of ``num_tokens`` tokens."""
    return _tokens_offset(version) + 4 * num_tokens


def _tokens_offset(version: int) -> int:
    return _META.size + (KEY_BYTES if version >= 2 else 0)


def encode_meta(chunk: StoredChunk) -> bytes:
    """The ``meta`` value of a chunk, checksum included."""
    value = bytearray(meta_bytes(chunk.num_tokens))
    _META.pack_into(
        value,
        0,
        _META_FORMAT_VERSION,
        0,
        chunk.num_tokens,
        chunk.source_start,
        chunk.raw_bytes,
        chunk.stored_bytes,
        chunk.num_frames,
        chunk.frame_bytes,
        chunk.last_access_ns,
        0,
    )
    value[_META.size : _META.size + KEY_BYTES] = chunk.parent_key or _NO_PARENT
    value[_tokens_offset(_META_FORMAT_VERSION) :] = chunk.tokens.astype("<u4", copy=False).tobytes()
    _seal(value)
    return bytes(value)


def decode_meta(key: bytes | memoryview, value: bytes | memoryview, *, with_tokens: bool = True) -> StoredChunk | None:
    """Parse a ``meta`` value; ``None`` when it is truncated, of an unknown version or fails its checksum.

    ``with_tokens=False`` leaves ``tokens`` empty (rebuilding the index at open needs only the sizes).
    """
    return decode_meta_values([key], [value], with_tokens=with_tokens)[0]


def decode_meta_values(
    keys: Sequence[bytes | memoryview], values: Sequence[bytes | memoryview], *, with_tokens: bool = True
) -> list[StoredChunk | None]:
    """``decode_meta`` of many records (inside their read transaction when they are views into the map).

    ``kvstore inspect`` lists every record through this (opening a data dir decodes arrays instead:
    ``meta_batch``), so it is written for speed: with tokens, the values are copied once, into one buffer, and
    each chunk's ``tokens`` is a view of it (a chunk kept alive keeps its batch's buffer alive); without, nothing is
    copied. Chunks are built without the dataclass's ``__init__`` (``_new_stored_chunk``).
    """
    joined = b"".join(values) if with_tokens else b""
    all_tokens = np.frombuffer(joined, dtype=_TOKEN_DTYPE, count=len(joined) // 4)
    unpack_from = _META.unpack_from
    offsets = _TOKENS_OFFSETS
    chunks: list[StoredChunk | None] = []
    end = 0
    for key, value in zip(keys, values, strict=True):
        # The value is buffer[start:end]: a slice of the joined copy, or (without tokens) the value itself.
        buffer, start, end = (joined, end, end + len(value)) if with_tokens else (value, 0, len(value))
        if len(key) != KEY_BYTES or end - start < _META.size:
            chunks.append(None)
            continue
        (version, _, num_tokens, source_start, raw_bytes, stored_bytes, num_frames, frame_bytes, last_access,
         checksum) = unpack_from(buffer, start)  # fmt: skip
        offset = offsets.get(version)
        if offset is None or end - start != offset + 4 * num_tokens:
            chunks.append(None)
            continue
        view = memoryview(buffer)
        hasher = _xxh3_64(view[start : start + _CHECKSUM_OFFSET])
        hasher.update(view[start + _CHECKSUM_OFFSET + 8 : end])
        if checksum != hasher.intdigest():
            chunks.append(None)
            continue
        parent = bytes(view[start + _META.size : start + offset]) if offset > _META.size else _NO_PARENT
        tokens = _NO_TOKENS
        if with_tokens:
            tokens_start = start + offset
            tokens = (
                all_tokens[tokens_start // 4 : end // 4]
                if tokens_start % 4 == 0  # every value before this one was whole
                else np.frombuffer(joined[tokens_start:end], dtype=_TOKEN_DTYPE)
            )
        chunk = _new_stored_chunk(
            bytes(key), num_tokens, source_start, raw_bytes, stored_bytes, num_frames, frame_bytes, last_access,
            tokens, None if parent == _NO_PARENT else parent,
        )  # fmt: skip
        chunks.append(chunk)
    return chunks


def _new_stored_chunk(
    key: bytes,
    num_tokens: int,
    source_start: int,
    raw_bytes: int,
    stored_bytes: int,
    num_frames: int,
    frame_bytes: int,
    last_access_ns: int,
    tokens: TokenArray,
    parent_key: bytes | None,
) -> StoredChunk:
    """A ``StoredChunk`` built without ``__init__``, for ``decode_meta_values`` only.

    A frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``, much slower than the slots' own
    setters (measured: docs/design-notes.md#tiers-frames-meta), and listing a million-chunk dir builds a million.
    ``StoredChunk`` has no ``__post_init__`` to skip; ``tests/tiers/frames/test_meta.py`` checks that both ways
    build equal chunks.
    """
    chunk = _new_object(StoredChunk)
    _set_key(chunk, key)
    _set_num_tokens(chunk, num_tokens)
    _set_source_start(chunk, source_start)
    _set_raw_bytes(chunk, raw_bytes)
    _set_stored_bytes(chunk, stored_bytes)
    _set_num_frames(chunk, num_frames)
    _set_frame_bytes(chunk, frame_bytes)
    _set_last_access_ns(chunk, last_access_ns)
    _set_tokens(chunk, tokens)
    _set_parent_key(chunk, parent_key)
    return chunk


def with_last_access(value: bytes | memoryview, last_access_ns: int) -> bytes:
    """A copy of a meta value with a new last-access time (re-sealed)."""
    patched = bytearray(value)
    _LAST_ACCESS.pack_into(patched, _LAST_ACCESS_OFFSET, last_access_ns)
    _seal(patched)
    return bytes(patched)


def _checksum(value: bytes | bytearray | memoryview) -> int:
    view = memoryview(value)
    hasher = xxhash.xxh3_64()
    hasher.update(view[:_CHECKSUM_OFFSET])
    hasher.update(view[_CHECKSUM_OFFSET + 8 :])
    return hasher.intdigest()


def _seal(value: bytearray) -> None:
    _LAST_ACCESS.pack_into(value, _CHECKSUM_OFFSET, _checksum(value))


def balanced_frame_bytes(chunk_bytes: int, element_size: int, num_codec_threads: int) -> int:
    """Frame size that cuts a full chunk into equal frames of at most 4 MiB, and into at least one frame per codec
    thread when each can still hold 1 MiB.

    Equal frames keep the codec threads equally busy: a 5.6 MiB SmolLM2 chunk cut 4 + 1.6 MiB decodes in the time
    of its 4 MiB frame, cut 2.8 + 2.8 MiB in 70% of it.
    """
    max_frame_bytes, min_frame_bytes = 4 * 2**20, 2**20
    num_frames = max(-(-chunk_bytes // max_frame_bytes), min(num_codec_threads, chunk_bytes // min_frame_bytes))
    frame_bytes = -(-chunk_bytes // max(1, num_frames))
    return -(-frame_bytes // element_size) * element_size
