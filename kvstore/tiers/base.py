"""The small interface every storage tier implements, and the values that cross it.

A tier holds chunk payloads by ``PrefixKey``. It knows nothing about other tiers: the ``TieredStore`` moves chunks
between them. When a tier must drop a chunk to make room it first hands it to its ``spill`` callback (the store
wires that to "demote into the next tier"), so eviction never loses a chunk that a lower tier could keep.

Contract shared by all tiers:

- ``put`` copies the caller's tensor (the caller may reuse it as soon as ``put`` returns) and returns ``False``
  (not an exception) when no room can be made because every resident chunk is pinned.
- ``get_into`` fills a caller's buffer and returns ``False`` on a miss, a vanished chunk or a corrupt one.
- A pinned chunk is never evicted; pins are reference counts.
- A watched tier tells its listener of every chunk that becomes or stops being resident (``watch``).
- All methods are thread-safe.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np
import numpy.typing as npt
import torch

from kvstore.keys import KEY_BYTES, PrefixKey, TokenArray, key_words
from kvstore.tiers.names import TierName  # re-exported: the name every tier module already imports from here

if TYPE_CHECKING:
    from kvstore.tiers.residency import ResidencyListener

__all__ = ["ChunkRecord", "ContentRecords", "SpillCallback", "Tier", "TierName", "TierStats"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkRecord:
    """Everything a tier keeps about a chunk besides its KV bytes.

    Args:
        key: prefix-chained key of the chunk.
        source_start: position of the chunk's first token in the sequence its KV was computed for.
        tokens: the chunk's token ids (kept by the disk tier so indexes can be rebuilt at start-up).
        parent_key: key of the previous chunk of the same sequence (``None`` for chunk 0); the disk tier keeps it
            so the content index can relink a sequence's chunks at start-up.
    """

    key: PrefixKey
    source_start: int
    tokens: TokenArray
    parent_key: PrefixKey | None = None

    def __post_init__(self) -> None:
        assert len(self.key) == 16, (
            "ChunkRecord.key must be a 16-byte PrefixKey; build it with keys.prefix_keys"
        )
        assert self.source_start >= 0, "ChunkRecord.source_start is a token position and cannot be negative"
        assert self.tokens.dtype == np.dtype("<u4"), "ChunkRecord.tokens must come from keys.as_token_array"

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


@dataclass(frozen=True, slots=True, kw_only=True)
class ContentRecords:
    """Many chunks' records without an object per chunk: what a content index rebuilds from
    (``DiskTier.iter_content_records``) and what a residency snapshot encodes (``Tier.resident_batches``).

    Chunk ``i`` has key ``keys[i]`` (also as two little-endian u64 words, ``key_words[i]``), parent key
    ``parent_words[i]`` (``[0, 0]``: none known), source start ``source_starts[i]`` and tokens
    ``tokens[token_starts[i]:token_ends[i]]``. The disk tier's ``tokens`` views a batch's meta values copied into one
    buffer, so the spans skip each value's header.
    """

    keys: Sequence[PrefixKey]
    key_words: npt.NDArray[np.uint64]
    parent_words: npt.NDArray[np.uint64]
    source_starts: npt.NDArray[np.uint64]
    tokens: TokenArray
    token_starts: npt.NDArray[np.int64]
    token_ends: npt.NDArray[np.int64]

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def parent_keys(self) -> list[PrefixKey | None]:
        """Each chunk's parent key as bytes, ``None`` when none is known (built on demand: tools and tests)."""
        joined = self.parent_words.astype("<u8", copy=False).tobytes()
        known = cast(list[bool], self.parent_words.any(axis=1).tolist())
        return [
            PrefixKey(joined[offset : offset + KEY_BYTES]) if is_known else None
            for offset, is_known in zip(range(0, len(joined), KEY_BYTES), known, strict=True)
        ]

    @staticmethod
    def of(records: Sequence[ChunkRecord]) -> ContentRecords:
        """``records`` in this form (a tier that holds record objects, for a reader of batches)."""
        lengths = np.fromiter((record.num_tokens for record in records), dtype=np.int64, count=len(records))
        ends = np.cumsum(lengths)
        keys = [record.key for record in records]
        return ContentRecords(
            keys=keys,
            key_words=key_words(keys),
            parent_words=key_words([record.parent_key or _NO_KEY for record in records]),
            source_starts=np.fromiter(
                (record.source_start for record in records), dtype=np.uint64, count=len(records)
            ),
            tokens=np.concatenate([record.tokens for record in records]) if records else _NO_TOKENS,
            token_starts=ends - lengths,
            token_ends=ends,
        )


_NO_KEY = bytes(KEY_BYTES)
_NO_TOKENS: TokenArray = np.zeros(0, dtype="<u4")


SpillCallback = Callable[[ChunkRecord, torch.Tensor], None]
"""Called with a chunk's record and a read-only view of its KV just before a tier drops it to make room."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TierStats:
    """A snapshot of one tier's counters.

    ``used_bytes`` counts KV bytes resident (uncompressed); ``stored_bytes`` counts what they occupy in the tier
    (compressed payload plus headers for disk, equal to ``used_bytes`` for memory tiers).

    **A hit** (the one definition, for ``hits``, ``hit_ratio``, ``kvstore_tier_hits_total`` and ``kvstore inspect``):
    a chunk a lookup planned from this tier -- the fastest tier holding it, where the lookup pins it. Every other
    chunk a lookup looked for is a miss of this tier (held by another tier, or by none). So ``hit_ratio`` is the
    share of looked-up chunks this tier served, and the tiers' ratios add up to the store's chunk hit ratio.
    Counted by the store (``LookupCounts``) since it opened; a tier used on its own counts none.
    """

    tier: TierName
    capacity_bytes: int
    used_bytes: int
    stored_bytes: int
    num_chunks: int
    num_pinned: int
    puts: int
    rejected_puts: int
    evictions: int
    corrupt_reads: int = 0
    hits: int = 0
    misses: int = 0

    @property
    def hit_ratio(self) -> float:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0

    @property
    def compression_ratio(self) -> float:
        return self.used_bytes / self.stored_bytes if self.stored_bytes else 1.0


class Tier(abc.ABC):
    """One storage level: contains / put / get-into-buffer / pin / unpin / evict / stats."""

    name: TierName

    @abc.abstractmethod
    def contains(self, key: PrefixKey) -> bool:
        """Whether the chunk is resident (a pending disk write counts)."""

    @abc.abstractmethod
    def num_tokens(self, key: PrefixKey) -> int | None:
        """Tokens in the chunk, or ``None`` when it is not resident."""

    @abc.abstractmethod
    def put(self, record: ChunkRecord, kv: torch.Tensor) -> bool:
        """Store a chunk (a no-op returning ``True`` when already resident).

        Args:
            record: the chunk's key, position and tokens.
            kv: ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]`` of the tier's layout, any device.

        Returns:
            ``False`` when no room could be made because every resident chunk is pinned.
        """

    @abc.abstractmethod
    def get_into(self, key: PrefixKey, out: torch.Tensor) -> bool:
        """Copy the chunk's KV into ``out`` (same shape as stored); ``False`` on a miss."""

    @abc.abstractmethod
    def record(self, key: PrefixKey) -> ChunkRecord | None:
        """The chunk's record (position, tokens, parent), or ``None`` when it is not resident."""

    @abc.abstractmethod
    def pin(self, key: PrefixKey) -> bool:
        """Protect a resident chunk from eviction (counted); ``False`` when it is not resident."""

    @abc.abstractmethod
    def unpin(self, key: PrefixKey) -> None:
        """Undo one ``pin``."""

    @abc.abstractmethod
    def evict(self, key: PrefixKey) -> bool:
        """Drop an unpinned chunk without spilling it; ``False`` when absent or pinned."""

    @abc.abstractmethod
    def evict_bytes(self, num_bytes: int) -> int:
        """Drop least-recently-used unpinned chunks (without spilling) until ``num_bytes`` are freed.

        Returns:
            Bytes actually freed (may be less when the rest is pinned).
        """

    @abc.abstractmethod
    def keys(self) -> list[PrefixKey]:
        """Resident keys, least recently used first."""

    @abc.abstractmethod
    def watch(self, listener: ResidencyListener) -> None:
        """Tell ``listener`` of every residency change from now on (``tiers.residency``); one listener at a time."""

    @abc.abstractmethod
    def resident_batches(self) -> Iterator[ContentRecords]:
        """The records of every resident chunk (a pending disk write counts), a batch at a time, for a listener that
        starts late: a chunk that comes or goes while this runs may be yielded or not, and its ``stored`` or
        ``removed`` call is what settles it."""

    @abc.abstractmethod
    def stats(self) -> TierStats:
        """A consistent snapshot of the counters."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release resources; later calls raise ``StoreClosedError``."""
