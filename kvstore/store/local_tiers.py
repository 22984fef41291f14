"""``LocalTiers``: a store's local tiers as one list, fastest first, and the moves between neighbours in it.

The store walks the list and never names a tier: a new chunk goes to the first tier with room, a lookup pins the
first tier holding a chunk, and a tier's victim spills into the next one. What sets a tier apart is what it can
do, not its name, and each role is found in the list by that:

- the **durable** tier (a ``DiskTier``: its copy survives a restart) takes a write-through of every chunk a memory
  tier takes, off the caller's path (``borrowed_writes``);
- the **landing** tier (a ``CpuTier``: slots in host memory a decoder writes into in place) is where prefetches
  land; a retrieved chunk found there is promoted into the fastest tier when that is another one.

Opening a tier is the one place that knows each kind's settings (``_open_tier``): add a kind there, in
``StoreConfig``'s speed order, and the rest of the store takes it in.

Threads: any number of callers; each tier guards its own state and no lock is held across tiers. The list is built
once, before the store is shared, and never changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from kvstore.config import StoreConfig
from kvstore.content.catalog import ContentRebuild
from kvstore.errors import ConfigError
from kvstore.keys import PrefixKey
from kvstore.layout import KVLayout
from kvstore.store.borrowed_writes import write_borrowing
from kvstore.store.fleet import Fleet
from kvstore.tiers.arena import ArenaTier
from kvstore.tiers.base import ChunkRecord, SpillCallback, Tier, TierName
from kvstore.tiers.cpu import CpuTier
from kvstore.tiers.disk.tier import DiskTier
from kvstore.tiers.disk.tuning import DiskTuning
from kvstore.tiers.gpu import GpuTier
from kvstore.tiers.residency import ResidencyListener

__all__ = ["LocalTiers"]


class LocalTiers:
    """The local tiers of a store, fastest first: build it with ``open``.

    Args:
        spilled: where a victim of the slowest tier goes when that is a memory tier (the fleet, under the
            ``evict`` write policy).
    """

    def __init__(self, spilled: Callable[[ChunkRecord, torch.Tensor], None]) -> None:
        self._spilled = spilled
        self._tiers: tuple[Tier, ...] = ()
        self.durable: DiskTier | None = None
        self.landing: CpuTier | None = None

    @classmethod
    def open(
        cls, config: StoreConfig, layout: KVLayout, fleet: Fleet, rebuild: ContentRebuild | None
    ) -> LocalTiers:
        """Open the local tiers ``config`` names, slowest first (the disk's recovery feeds ``rebuild`` as it reads
        its records), each memory tier spilling into the next slower one.

        Raises:
            ConfigError: a tier cannot open with these settings (the ones opened before it are closed again).
        """
        names = [name for name in config.tiers if name is not TierName.REMOTE]
        local = cls(fleet.spilled)
        opened: dict[TierName, Tier] = {}
        try:
            for position in reversed(range(len(names))):
                spill = local._spill_from(position)
                opened[names[position]] = _open_tier(names[position], config, layout, fleet, rebuild, spill)
        except BaseException:
            for tier in opened.values():
                tier.close()
            raise
        local._adopt([opened[name] for name in names])
        return local

    def _adopt(self, tiers: Sequence[Tier]) -> None:
        self._tiers = tuple(tiers)
        self.durable = next((tier for tier in tiers if isinstance(tier, DiskTier)), None)
        self.landing = next((tier for tier in tiers if isinstance(tier, CpuTier)), None)

    def __iter__(self) -> Iterator[Tier]:
        return iter(self._tiers)

    @property
    def fastest(self) -> Tier | None:
        return self._tiers[0] if self._tiers else None

    def named(self, name: TierName) -> Tier | None:
        return next((tier for tier in self._tiers if tier.name is name), None)

    def require(self, name: TierName) -> Tier:
        """The tier called ``name``.

        Raises:
            ConfigError: the store has no such tier.
        """
        tier = self.named(name)
        if tier is None:
            held = ",".join(tier.name.value for tier in self._tiers)
            raise ConfigError(f"this store has no {name.value} tier (tiers: {held})")
        return tier

    def watch(self, listener: ResidencyListener) -> None:
        for tier in self._tiers:
            tier.watch(listener)

    def holds(self, key: PrefixKey) -> bool:
        return any(tier.contains(key) for tier in self._tiers)

    def in_transit(self, key: PrefixKey) -> bool:
        return any(isinstance(tier, ArenaTier) and tier.in_transit(key) for tier in self._tiers)

    def record(self, key: PrefixKey) -> ChunkRecord | None:
        """The chunk's record (its tokens, position, parent) from the fastest tier holding it (the disk reads its
        meta value), ``None`` when none does."""
        for tier in self._tiers:
            record = tier.record(key)
            if record is not None:
                return record
        return None

    def pin_fastest(self, key: PrefixKey) -> Tier | None:
        """Pin the chunk in the fastest tier holding it; returns that tier (``None``: no local tier holds it)."""
        return next((tier for tier in self._tiers if tier.pin(key)), None)

    def put_new(self, record: ChunkRecord, kv: torch.Tensor) -> Tier | None:
        """Put a chunk into the fastest tier with room, then write it through to the durable tier off the caller's
        path. Returns the tier that took it (``None``: every tier is pinned full)."""
        for tier in self._tiers:
            if not tier.put(record, kv):
                continue
            durable = self.durable
            if durable is not None and tier is not durable:  # borrowing the landing slot where it can
                write_borrowing(tier, record, kv, put=durable.put, put_borrowed=durable.put_borrowed)
            return tier
        return None

    def _spill_from(self, position: int) -> SpillCallback:
        """The spill callback of the tier at ``position``: its victims go to the next slower tier (past the slowest:
        ``spilled``). A memory tier's put of a chunk it holds marks it recently used; a durable copy that is already
        there is kept as it is."""

        def spill(record: ChunkRecord, kv: torch.Tensor) -> None:
            if position + 1 >= len(self._tiers):
                self._spilled(record, kv)
                return
            below = self._tiers[position + 1]
            if isinstance(below, ArenaTier) or not below.contains(record.key):
                below.put(record, kv)

        return spill

    def promote(self, keys: Sequence[PrefixKey]) -> None:
        """Copy retrieved chunks that sit in the landing tier into the fastest tier, when that is another one (after
        the plan's pins are gone, so the fastest tier can evict its own cold chunks to make room)."""
        fastest, landing = self.fastest, self.landing
        if fastest is None or landing is None or fastest is landing:
            return
        for key in keys:
            if fastest.contains(key) or not landing.pin(key):
                continue
            try:
                record = landing.record(key)
                if record is not None:
                    fastest.put(record, landing.view(key))
            finally:
                landing.unpin(key)

    def close(self) -> None:
        """Close every tier, slowest first: a slower tier's writers may still read a faster one's pinned slots
        (write-throughs borrow them), and closing it drains them."""
        for tier in reversed(self._tiers):
            tier.close()


def _open_tier(
    name: TierName,
    config: StoreConfig,
    layout: KVLayout,
    fleet: Fleet,
    rebuild: ContentRebuild | None,
    spill: SpillCallback,
) -> Tier:
    """Open one local tier with its settings from ``config``."""
    if name is TierName.GPU:
        return GpuTier(layout, config.chunk_size, config.gpu_capacity_bytes, device=config.gpu_device, spill=spill)
    if name is TierName.CPU:
        return CpuTier(
            layout, config.chunk_size, config.cpu_capacity_bytes, spill=spill, shared_memory=config.cpu_shared_memory
        )
    assert name is TierName.DISK, f"_open_tier has no case for the local tier {name}; add one"
    return DiskTier(
        config.data_dir,
        layout,
        config.chunk_size,
        config.disk_capacity_bytes,
        zstd_level=config.disk_zstd_level,
        num_codec_threads=config.disk_codec_threads,
        # with a cpu tier, writes borrow its slots (put_borrowed): staging serves only rare spills
        tuning=DiskTuning(preallocate_staging=TierName.CPU not in config.tiers),
        content_records=None if rebuild is None else rebuild.add,  # one pass over the meta records
        on_evict=fleet.evicted if fleet.writes_on_eviction else None,
        chunking=config.chunking,
    )
