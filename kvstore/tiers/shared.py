"""``SharedTier``: the contract of a tier many hosts share, which the store coordinates beside its local ``Tier``s.

A local tier pins: a lookup pins every chunk it plans, and the pin holds until the retrieve. A shared tier cannot
(another host's writes, or the service's own eviction, decide what stays), so it has a contract of its own::

    knows(key)               what this host believes the tier holds (it wrote it, or the fleet said so); a lookup
                             plans such chunks unpinned, and a read of one that is gone is an ordinary miss
    put / put_borrowed       queue a write off the caller's path (``False``: dropped, the tier is backed up or down)
    put_evicted              keep chunks a local tier evicted, as they were stored (``kvstore.tiers.frames``)
    fetch / decode_into      read a group of chunks in one round trip, then decode each into its place
    count_inconsistent       a chunk that came back of another length than the plan said
    flush / stats / close

The store holds a list of them (``TieredStore``: none, or the remote tier), never a special case per tier.

Thread-safe, as every tier.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

import torch

from kvstore.keys import PrefixKey
from kvstore.misses import MissReason
from kvstore.tiers.base import ChunkRecord, TierName, TierStats
from kvstore.tiers.frames.evicted import EvictedChunk

__all__ = ["SharedChunk", "SharedTier"]


class SharedChunk(Protocol):
    """A chunk a shared tier fetched, not decoded yet."""

    @property
    def record(self) -> ChunkRecord: ...


ChunkT = TypeVar("ChunkT", bound=SharedChunk)


class SharedTier(abc.ABC, Generic[ChunkT]):
    """A tier many hosts share: writes are queued, reads come in groups, nothing is pinned (module docstring).

    Generic in what ``fetch`` returns, which only the same tier's ``decode_into`` takes."""

    name: TierName

    @abc.abstractmethod
    def knows(self, key: PrefixKey) -> bool:
        """Whether this host believes the tier holds the chunk."""

    @abc.abstractmethod
    def put(self, record: ChunkRecord, kv: torch.Tensor) -> bool:
        """Queue a copy of the chunk for writing; ``False`` when the write was dropped."""

    @abc.abstractmethod
    def put_borrowed(self, record: ChunkRecord, kv: torch.Tensor, on_done: Callable[[], None]) -> bool:
        """Queue a write that reads ``kv`` in place (a pinned cpu slot) and calls ``on_done`` once it no longer
        needs it (also when the write is dropped)."""

    @abc.abstractmethod
    def put_evicted(self, chunks: Sequence[EvictedChunk]) -> list[ChunkRecord]:
        """Queue chunks a local tier evicted, as stored; returns the records of those queued."""

    @abc.abstractmethod
    def fetch(self, keys: Sequence[PrefixKey]) -> Sequence[ChunkT | MissReason]:
        """Read chunks in one round trip; for each one not read, why: ``EVICTED_REMOTE`` (gone), ``CHECKSUM``
        (damaged) or ``REMOTE_UNAVAILABLE`` (the tier did not answer)."""

    @abc.abstractmethod
    def why_forgotten(self, key: PrefixKey) -> MissReason:
        """Why a chunk this tier stopped knowing (a fetch found it gone or damaged) is not read."""

    @abc.abstractmethod
    def decode_into(self, chunk: ChunkT, out: torch.Tensor) -> bool:
        """Decode a fetched chunk into ``out`` (its shape, any device); ``False`` when it fails its checks."""

    @abc.abstractmethod
    def count_inconsistent(self, key: PrefixKey) -> None:
        """A chunk came back of another length than planned: count it and forget the key."""

    @abc.abstractmethod
    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued write was sent (or dropped); ``False`` on timeout."""

    @abc.abstractmethod
    def stats(self) -> TierStats:
        """A snapshot of the counters (hits and misses are the store's, ``LookupCounts``)."""

    @abc.abstractmethod
    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (within ``timeout_s``), then stop."""
