"""What the disk tier keeps in LMDB: the sub-databases and their key formats.

One environment per data dir (``<dir>/data.mdb``) with four named sub-databases::

    payload  key: prefix key (16 B) | frame index (u16, big-endian)   value: one frame (``tiers.frames.codec``)
    meta     key: prefix key (16 B)                                    value: chunk meta (``tiers.frames.meta``)
    intent   key: prefix key (16 B)                                    value: num_frames (u32, little-endian)
    info     key: b"format_version", b"layout", b"chunk_size", b"chunking", ...     value: utf-8 text

Big-endian frame indexes keep a chunk's frames adjacent and in order in the B-tree. A chunk's frames are
committed in short transactions and its meta in the transaction of its last frame; an ``intent`` record marks
a chunk whose first frames committed but whose meta has not yet (commit), so recovery removes the frames
of a chunk cut short by a crash: a chunk is either whole or absent. A data dir written before ``intent``
existed opens unchanged (the sub-database is created at the first writable open).

The chunk meta value itself (its bytes, version and checksum) is the stored frame's: ``kvstore.tiers.frames.meta``.

Pure functions and constants; thread-safe.
"""

from __future__ import annotations

from kvstore.keys import PrefixKey

__all__ = [
    "DATA_DIR_FORMAT_VERSION",
    "INFO_CAPACITY_BYTES",
    "INFO_CHUNKING",
    "INFO_CHUNK_SIZE",
    "INFO_FORMAT_VERSION",
    "INFO_LAYOUT",
    "encode_intent",
    "frame_key",
]

DATA_DIR_FORMAT_VERSION = 1
INFO_FORMAT_VERSION = b"format_version"
INFO_LAYOUT = b"layout"
INFO_CHUNK_SIZE = b"chunk_size"
INFO_CAPACITY_BYTES = b"capacity_bytes"
INFO_CHUNKING = b"chunking"  # the cut rule (kvstore.chunking); a dir without it was cut "fixed"


def frame_key(key: PrefixKey, frame_idx: int) -> bytes:
    """LMDB key of frame ``frame_idx`` of a chunk in the ``payload`` sub-database."""
    return key + frame_idx.to_bytes(2, "big")


def encode_intent(num_frames: int) -> bytes:
    """The ``intent`` value of a chunk being written: how many frames it will have."""
    return num_frames.to_bytes(4, "little")
