"""A chunk a tier lets go of, as stored (its meta record and encoded frames), for a tier below it to keep as is.

With the remote tier's ``evict`` write policy a chunk reaches the remote only when it leaves the disk, so the
remote holds what no local tier keeps any more. The disk tier reads its capacity victims out
(``kvstore.tiers.disk.victim_reads``) and hands them over: nothing is decoded or re-encoded on the way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.keys import PrefixKey

__all__ = ["EvictedChunk", "EvictionSink"]


@dataclass(frozen=True, slots=True)
class EvictedChunk:
    """A capacity victim as its tier held it.

    Attributes:
        key: its prefix key.
        meta: its meta record (``kvstore.tiers.frames.meta``), checksum included.
        frames: its encoded frames (``kvstore.tiers.frames.codec``), in order.
    """

    key: PrefixKey
    meta: bytes
    frames: tuple[bytes, ...]


EvictionSink = Callable[[Sequence[EvictedChunk]], None]
"""Receives the victims of one eviction on the evicting tier's writer thread; it must only queue work (it holds the
writer)."""
