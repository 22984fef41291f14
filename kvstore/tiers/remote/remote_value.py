"""A chunk as one Valkey value: the disk tier's checksummed meta record and codec frames, behind a small header.

::

    offset      size   field (little-endian)
    0           4      magic b"KVR\\x01"
    4           4      meta bytes M (u32)
    8           4      number of frames F (u32)
    12          4      reserved, zero
    16          16     the chunk's prefix key (a value under another chunk's name is refused)
    32          8*F    stored bytes of each frame (u64)
    32+8F       M      the chunk's meta record (``kvstore.tiers.frames.meta``: tokens, positions, parent key, raw
                       and frame bytes; sealed by its own xxh3 checksum)
    32+8F+M     ...    frame 0 | frame 1 | ... (``kvstore.tiers.frames.codec``: byte planes, zstd, each checksummed)

So the remote holds exactly what the disk tier holds, and one ``GET`` brings everything a host needs to land the
chunk in its own tiers (its record included). Nothing in the header is trusted: the meta record and every frame
carry checksums, sizes are checked against each other before anything is decoded, and any defect (a truncated
value, a bit flip, a value of another format, the wrong chunk under a key, checked by chaining the record's parent
key and tokens back to the key asked for) is reported as ``None`` or a failed
``FrameStatus``: a miss, never an exception and never wrong bytes.

Pure functions; thread-safe (the codec keeps per-thread zstd state).
"""

from __future__ import annotations

import dataclasses
import itertools
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvstore.keys import PrefixKey, chained_key
from kvstore.tiers.base import ChunkRecord
from kvstore.tiers.frames.codec import FrameCodec, FrameStatus
from kvstore.tiers.frames.meta import StoredChunk, decode_meta, encode_meta

__all__ = [
    "RemoteChunk",
    "assemble_remote_value",
    "decode_remote_value",
    "decode_remote_value_into",
    "encode_remote_value",
]

_MAGIC = b"KVR\x01"
_HEADER = struct.Struct("<4sIII16s")
_FRAME_SIZE = struct.Struct("<Q")
_MAX_FRAMES = 2**16


@dataclass(frozen=True, slots=True)
class RemoteChunk:
    """A value fetched from the remote, its header and meta checked, its frames not yet decoded.

    Attributes:
        record: the chunk's key, position, tokens and parent key.
        raw_bytes: uncompressed KV bytes.
        stored_bytes: the value's length.
        frame_bytes: raw bytes per frame (the last may be shorter).
        frames: views of each encoded frame inside the value.
    """

    record: ChunkRecord
    raw_bytes: int
    stored_bytes: int
    frame_bytes: int
    frames: tuple[memoryview, ...]


def encode_remote_value(
    record: ChunkRecord, data: npt.NDArray[np.uint8], codec: FrameCodec, frame_bytes: int, *, now_ns: int
) -> bytes:
    """Encode a chunk's raw KV bytes into one value.

    Args:
        record: the chunk's record.
        data: its raw KV bytes (contiguous uint8).
        codec: the layout's frame codec.
        frame_bytes: raw bytes per frame (``balanced_frame_bytes``).
        now_ns: the write time recorded as the chunk's last access.
    """
    raw_bytes = int(data.shape[0])
    frames = [codec.encode(data[start : start + frame_bytes]) for start in range(0, raw_bytes, frame_bytes)]
    stored = StoredChunk(
        key=record.key,
        num_tokens=record.num_tokens,
        source_start=record.source_start,
        raw_bytes=raw_bytes,
        stored_bytes=0,  # set by assemble_remote_value
        num_frames=len(frames),
        frame_bytes=frame_bytes,
        last_access_ns=now_ns,
        tokens=record.tokens,
        parent_key=record.parent_key,
    )
    return assemble_remote_value(stored, frames)


def assemble_remote_value(stored: StoredChunk, frames: Sequence[bytes]) -> bytes:
    """One value from a chunk's meta record and its encoded frames (as the disk tier holds them): the meta's
    ``stored_bytes`` becomes the value's length, and it is sealed again."""
    frame_table = b"".join(_FRAME_SIZE.pack(len(frame)) for frame in frames)
    meta_length = len(encode_meta(stored))  # fixed by the token count
    total = _HEADER.size + len(frame_table) + meta_length + sum(len(frame) for frame in frames)
    meta = encode_meta(dataclasses.replace(stored, stored_bytes=total, num_frames=len(frames)))
    header = _HEADER.pack(_MAGIC, len(meta), len(frames), 0, stored.key)
    return b"".join([header, frame_table, meta, *frames])


def decode_remote_value(
    key: PrefixKey, value: bytes | bytearray | memoryview | None, namespace: bytes
) -> RemoteChunk | None:
    """Check a fetched value's header and meta record; ``None`` for a missing or defective value, or one of
    another chunk.

    The header's key is not covered by a checksum, so the checksummed meta record must produce it: a chunk's key
    is ``chained_key(parent key or namespace, tokens)``, and a value whose record chains to another key (another
    chunk's value under this name, a header rewritten) is refused."""
    if value is None or len(value) < _HEADER.size:
        return None
    view = memoryview(value).cast("B")
    magic, meta_length, num_frames, reserved, own_key = _HEADER.unpack_from(view, 0)
    if magic != _MAGIC or reserved or own_key != key or not 0 < num_frames <= _MAX_FRAMES:
        return None
    table_end = _HEADER.size + _FRAME_SIZE.size * num_frames
    meta_end = table_end + meta_length
    if meta_end > len(view):
        return None
    sizes = np.frombuffer(view[_HEADER.size : table_end], dtype="<u8").tolist()  # Python ints: no wrap-around
    if sum(sizes) != len(view) - meta_end:
        return None
    stored = decode_meta(key, view[table_end:meta_end])
    if (
        stored is None
        or stored.num_frames != num_frames
        or stored.stored_bytes != len(view)
        or stored.frame_bytes <= 0
        or -(-stored.raw_bytes // stored.frame_bytes) != num_frames
    ):
        return None
    tokens = np.array(stored.tokens, dtype="<u4")  # its own copy: the value may be a reused buffer
    if chained_key(stored.parent_key or namespace, tokens) != key:
        return None
    offsets = list(itertools.accumulate(sizes, initial=meta_end))
    frames = tuple(view[start:end] for start, end in itertools.pairwise(offsets))
    record = ChunkRecord(
        key=stored.key,
        source_start=stored.source_start,
        tokens=tokens,
        parent_key=stored.parent_key,
    )
    return RemoteChunk(
        record=record,
        raw_bytes=stored.raw_bytes,
        stored_bytes=len(view),
        frame_bytes=stored.frame_bytes,
        frames=frames,
    )


def decode_remote_value_into(chunk: RemoteChunk, codec: FrameCodec, out: npt.NDArray[np.uint8]) -> FrameStatus:
    """Decode every frame into ``out`` (contiguous uint8 of exactly ``chunk.raw_bytes``); the first defect wins."""
    if out.shape[0] != chunk.raw_bytes:
        return FrameStatus.SIZE_MISMATCH
    for index, frame in enumerate(chunk.frames):
        start = index * chunk.frame_bytes
        status = codec.decode_into(frame, out[start : min(start + chunk.frame_bytes, chunk.raw_bytes)])
        if status is not FrameStatus.OK:
            return status
    return FrameStatus.OK
