"""``TieredStore``: the public entry point that splits KV into chunks and moves them between tiers.

Data flows one way: engine -> ``TieredStore`` -> tiers. The store owns the tiers and wires them together:

- **store**: chunks go to the fastest tier that has room; when a disk tier exists each new chunk is also written
  through to it asynchronously (the disk writer reads the pinned cpu slot directly, or a staging copy), so the cache
  survives a restart without the caller waiting for zstd or LMDB.
- **eviction demotes**: a tier that needs room spills its least recently used chunk into the next slower tier
  (gpu -> cpu -> disk); a chunk the disk already holds is simply dropped from memory.
- **lookup** walks the prompt's prefix keys and pins each chunk in the fastest tier holding it.
- **retrieve** copies the pinned chunks into the caller's buffer (or a new tensor) and, when ``promote_on_hit`` is
  set, promotes disk hits into the cpu tier (decoding straight into the slot) and cpu hits into the gpu tier.

Threads: any number of callers. Each tier guards its own state; the store's ``_lookups_lock`` guards
``_open_lookups`` and ``_next_lookup_id`` and ``_scratch_lock`` guards the decode buffer used when no cpu tier exists.
No lock is held while calling into a tier, so locks never nest across tiers.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

import numpy as np
import numpy.typing as npt
import torch

from kvstore.config import StoreConfig
from kvstore.errors import ConfigError, InvalidInputError, StoreClosedError
from kvstore.keys import PrefixKey, as_token_array, prefix_keys
from kvstore.layout import KVLayout
from kvstore.plan import CachedChunk, PrefixLookup, RetrieveResult, StoreResult
from kvstore.tiers.arena import ArenaTier
from kvstore.tiers.base import ChunkRecord, Tier, TierName, TierStats
from kvstore.tiers.cpu import CpuTier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.gpu import GpuTier

__all__ = ["StoreStats", "TieredStore"]

logger = logging.getLogger(__name__)


class _Lifecycle(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreStats:
    """Counters of the store and each of its tiers (fastest first)."""

    tiers: tuple[TierStats, ...]
    num_open_lookups: int

    def tier(self, name: TierName) -> TierStats | None:
        return next((stats for stats in self.tiers if stats.tier is name), None)


class TieredStore:
    """KV chunks in gpu/cpu/disk tiers, found by prefix key.

    Example::

        layout = KVLayout(model_id="my-model", num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16")
        with TieredStore(layout, StoreConfig(disk_path=Path("kvstore-data"))) as store:
            store.store(tokens, kv)                     # kv: [30, 2, len(tokens), 3, 64] bf16
            lookup = store.lookup(tokens + more_tokens)
            result = store.retrieve(lookup)             # result.kv: the cached prefix's KV

    Args:
        layout: the model's KV layout; every chunk must have it (a data dir keeps the one it was created with).
        config: tiers, sizes and the data dir.
    """

    def __init__(self, layout: KVLayout, config: StoreConfig | None = None) -> None:
        self.layout = layout
        self.config = config or StoreConfig()
        self._namespace = layout.namespace
        self._gpu: GpuTier | None = None
        self._cpu: CpuTier | None = None
        self._disk: DiskTier | None = None
        self._tiers: list[Tier] = []
        self._lookups_lock = threading.Lock()
        self._open_lookups: dict[int, PrefixLookup] = {}
        self._next_lookup_id = 1
        self._scratch_lock = threading.Lock()
        self._scratch: torch.Tensor | None = None
        try:
            self._open_tiers()
        except BaseException:
            self._close_tiers()
            raise
        self._lifecycle = _Lifecycle.OPEN
        logger.info(
            "store open: %s, tiers %s, chunk %d tokens",
            layout.describe(),
            ",".join(t.name.value for t in self._tiers),
            self.config.chunk_size,
        )

    def _open_tiers(self) -> None:
        config = self.config
        if TierName.DISK in config.tiers:
            self._disk = DiskTier(
                config.disk_path,
                self.layout,
                config.chunk_size,
                config.disk_capacity_bytes,
                zstd_level=config.disk_zstd_level,
                num_codec_threads=config.disk_codec_threads,
            )
        if TierName.CPU in config.tiers:
            self._cpu = CpuTier(
                self.layout, config.chunk_size, config.cpu_capacity_bytes, spill=self._spill_to_disk
            )
        if TierName.GPU in config.tiers:
            self._gpu = GpuTier(
                self.layout,
                config.chunk_size,
                config.gpu_capacity_bytes,
                device=config.gpu_device,
                spill=self._spill_to_cpu,
            )
        self._tiers = [tier for tier in (self._gpu, self._cpu, self._disk) if tier is not None]

    # -- demotion ---------------------------------------------------------------------------------------------

    def _spill_to_cpu(self, record: ChunkRecord, kv: torch.Tensor) -> None:
        """gpu victim -> cpu tier (or straight to disk when there is no cpu tier)."""
        if self._cpu is not None:
            self._cpu.put(record, kv)
        else:
            self._spill_to_disk(record, kv)

    def _spill_to_disk(self, record: ChunkRecord, kv: torch.Tensor) -> None:
        """Memory victim -> disk, unless the write-through already put it there."""
        if self._disk is not None and not self._disk.contains(record.key):
            self._disk.put(record, kv)

    # -- store ------------------------------------------------------------------------------------------------

    def store(self, tokens: Sequence[int] | npt.NDArray[np.integer], kv: torch.Tensor) -> StoreResult:
        """Cache the KV of a token sequence, chunk by chunk.

        Args:
            tokens: the sequence's token ids, from position 0.
            kv: ``[num_layers, 2, len(tokens), num_kv_heads, head_dim]`` in the layout's dtype, on the cpu or a GPU.

        Returns:
            How many chunks were new.

        Raises:
            InvalidInputError: the KV does not match the tokens or the layout.
        """
        self._check_open()
        token_array = as_token_array(tokens)
        self.layout.check_kv(kv, len(token_array))
        if kv.device.type not in ("cpu", "cuda"):
            raise InvalidInputError(f"kv is on device {kv.device}; hand over a cpu or cuda tensor")
        chunk_size = self.config.chunk_size
        keys = prefix_keys(self._namespace, token_array, chunk_size)
        num_new = num_rejected = 0
        for index, key in enumerate(keys):
            if any(tier.contains(key) for tier in self._tiers):
                continue
            start = index * chunk_size
            end = min(start + chunk_size, len(token_array))
            record = ChunkRecord(key=key, source_start=start, tokens=token_array[start:end])
            if self._put_new_chunk(record, kv[:, :, start:end]):
                num_new += 1
            else:
                num_rejected += 1
        if num_rejected:
            logger.warning(
                "store: %d of %d chunks rejected, every tier is pinned full", num_rejected, len(keys)
            )
        return StoreResult(num_chunks=len(keys), num_new_chunks=num_new, num_rejected_chunks=num_rejected)

    def _put_new_chunk(self, record: ChunkRecord, kv: torch.Tensor) -> bool:
        """Put into the fastest tier with room, then write through to disk off the caller's path."""
        for tier in self._tiers:
            if not tier.put(record, kv):
                continue
            if self._disk is not None and tier is not self._disk:
                self._write_through(tier, record, kv)
            return True
        return False

    def _write_through(self, tier: Tier, record: ChunkRecord, kv: torch.Tensor) -> None:
        assert self._disk is not None
        if isinstance(tier, ArenaTier) and tier.device.type == "cpu" and tier.pin(record.key):
            # Zero-copy: the disk writer reads the pinned slot and unpins it when done.
            def unpin() -> None:
                tier.unpin(record.key)

            self._disk.put_borrowed(record, tier.view(record.key), on_done=unpin)
        else:
            self._disk.put(record, kv)

    # -- lookup / retrieve / release ----------------------------------------------------------------------------

    def lookup(self, tokens: Sequence[int] | npt.NDArray[np.integer]) -> PrefixLookup:
        """Find the cached prefix of a prompt and pin its chunks until ``retrieve`` or ``release``.

        Args:
            tokens: the prompt's token ids.

        Returns:
            The cached leading chunks (possibly none) and where each one is.
        """
        self._check_open()
        token_array = as_token_array(tokens)
        chunk_size = self.config.chunk_size
        chunks: list[CachedChunk] = []
        for index, key in enumerate(prefix_keys(self._namespace, token_array, chunk_size)):
            tier = self._pin_fastest(key)
            if tier is None:
                break
            start = index * chunk_size
            chunks.append(
                CachedChunk(
                    key=key, start=start, num_tokens=min(chunk_size, len(token_array) - start), tier=tier.name
                )
            )
        with self._lookups_lock:
            lookup = PrefixLookup(
                lookup_id=self._next_lookup_id, num_query_tokens=len(token_array), chunks=tuple(chunks)
            )
            self._next_lookup_id += 1
            self._open_lookups[lookup.lookup_id] = lookup
        return lookup

    def _pin_fastest(self, key: PrefixKey) -> Tier | None:
        for tier in self._tiers:
            if tier.pin(key):
                return tier
        return None

    def release(self, lookup: PrefixLookup) -> None:
        """Drop the pins of a lookup that will not be retrieved. Idempotent."""
        with self._lookups_lock:
            if self._open_lookups.pop(lookup.lookup_id, None) is None:
                return
        self._unpin_chunks(lookup.chunks)

    def _unpin_chunks(self, chunks: Sequence[CachedChunk]) -> None:
        for chunk in chunks:
            self._tier(chunk.tier).unpin(chunk.key)

    def retrieve(
        self, lookup: PrefixLookup, out: torch.Tensor | None = None, *, device: str | torch.device = "cpu"
    ) -> RetrieveResult:
        """Load the KV of a lookup's cached prefix and release its pins.

        Args:
            lookup: from ``lookup``; each lookup is retrieved (or released) once.
            out: a buffer ``[num_layers, 2, >= num_cached_tokens, num_kv_heads, head_dim]`` of the layout's dtype
                on any device; when omitted a tensor is allocated on ``device``.
            device: where to allocate when ``out`` is omitted.

        Returns:
            The loaded token count and KV (a view of ``out`` when given).

        Raises:
            ConfigError: the lookup was already retrieved or released.
            InvalidInputError: ``out`` has the wrong shape or dtype.
        """
        self._check_open()
        with self._lookups_lock:
            if self._open_lookups.pop(lookup.lookup_id, None) is None:
                raise ConfigError(
                    f"lookup {lookup.lookup_id} was already retrieved or released; call lookup() again"
                )
        try:
            out = self._prepare_out(lookup, out, device)
            loaded = 0
            for chunk in lookup.chunks:
                if not self._load_chunk(chunk, out[:, :, chunk.start : chunk.end]):
                    logger.warning(
                        "retrieve: chunk %s failed to load; prefix cut at %d", chunk.key.hex(), loaded
                    )
                    break
                loaded = chunk.end
        finally:
            self._unpin_chunks(lookup.chunks)
        if self.config.promote_on_hit and self._gpu is not None:
            self._promote_to_gpu([c for c in lookup.chunks if c.tier is not TierName.GPU and c.end <= loaded])
        return RetrieveResult(num_tokens=loaded, kv=out[:, :, :loaded])

    def _prepare_out(
        self, lookup: PrefixLookup, out: torch.Tensor | None, device: str | torch.device
    ) -> torch.Tensor:
        needed = lookup.num_cached_tokens
        if out is None:
            return torch.empty(
                self.layout.chunk_shape(needed), dtype=self.layout.dtype.torch_dtype, device=device
            )
        if out.dim() != 5 or out.shape[2] < needed:
            raise InvalidInputError(
                f"out shape {list(out.shape)} cannot hold {needed} cached tokens; "
                f"expected {list(self.layout.chunk_shape(needed))} (or more tokens)"
            )
        self.layout.check_kv(out[:, :, :needed], needed)
        return out

    def _load_chunk(self, chunk: CachedChunk, out: torch.Tensor) -> bool:
        """Copy one pinned chunk into ``out`` and promote it one tier up when configured."""
        tier = self._tier(chunk.tier)
        if isinstance(tier, ArenaTier):
            out.copy_(tier.view(chunk.key))
            return True
        return self._load_from_disk(chunk, out)

    def _promote_to_gpu(self, chunks: Sequence[CachedChunk]) -> None:
        """Copy retrieved chunks that sit in the cpu tier into the gpu tier (after the lookup's pins are gone,
        so the gpu tier can evict its own cold chunks to make room)."""
        assert self._gpu is not None
        for chunk in chunks:
            if self._cpu is None or self._gpu.contains(chunk.key) or not self._cpu.pin(chunk.key):
                continue
            try:
                record = self._cpu.record(chunk.key)
                if record is not None:
                    self._gpu.put(record, self._cpu.view(chunk.key))
            finally:
                self._cpu.unpin(chunk.key)

    def _load_from_disk(self, chunk: CachedChunk, out: torch.Tensor) -> bool:
        assert self._disk is not None
        disk = self._disk
        landing = self._cpu if self.config.promote_on_hit and self._cpu is not None else None
        if landing is not None:
            record = disk.record(chunk.key)
            landed = record is not None and landing.put_with(record, lambda view: disk.get_into(chunk.key, view))
            if landed and landing.pin(chunk.key):
                try:
                    out.copy_(landing.view(chunk.key))
                finally:
                    landing.unpin(chunk.key)
                return True
        if out.device.type == "cpu" and out.is_contiguous():
            return disk.get_into(chunk.key, out)
        with self._scratch_lock:
            scratch = self._scratch_for(chunk.num_tokens)
            if not disk.get_into(chunk.key, scratch):
                return False
            out.copy_(scratch)
            return True

    def _scratch_for(self, num_tokens: int) -> torch.Tensor:
        if self._scratch is None:
            self._scratch = torch.empty(
                self.layout.chunk_bytes(self.config.chunk_size),
                dtype=torch.uint8,
                pin_memory=torch.cuda.is_available(),
            )
        raw = self._scratch[: self.layout.chunk_bytes(num_tokens)]
        return raw.view(self.layout.dtype.torch_dtype).view(self.layout.chunk_shape(num_tokens))

    # -- admin --------------------------------------------------------------------------------------------------

    def contains(self, key: PrefixKey) -> list[TierName]:
        """Tiers that hold a chunk, fastest first."""
        return [tier.name for tier in self._tiers if tier.contains(key)]

    def evict(self, keys: Sequence[PrefixKey]) -> int:
        """Drop chunks from every tier (pinned copies stay). Returns how many chunk copies were dropped."""
        self._check_open()
        return sum(tier.evict(key) for key in keys for tier in self._tiers)

    def evict_bytes(self, num_bytes: int, tier: TierName) -> int:
        """Free ``num_bytes`` of one tier, least recently used first, without demoting. Returns bytes freed."""
        self._check_open()
        return self._tier(tier).evict_bytes(num_bytes)

    def flush(self) -> None:
        """Block until every pending disk write is committed and synced."""
        self._check_open()
        if self._disk is not None:
            self._disk.flush()

    def stats(self) -> StoreStats:
        with self._lookups_lock:
            num_open = len(self._open_lookups)
        return StoreStats(tiers=tuple(tier.stats() for tier in self._tiers), num_open_lookups=num_open)

    def _tier(self, name: TierName) -> Tier:
        for tier in self._tiers:
            if tier.name is name:
                return tier
        raise ConfigError(f"this store has no {name} tier (tiers: {','.join(t.name for t in self._tiers)})")

    # -- lifecycle ----------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Release open lookups, flush pending disk writes, close the tiers. Idempotent."""
        if self._lifecycle is _Lifecycle.CLOSED:
            return
        with self._lookups_lock:
            open_lookups = list(self._open_lookups.values())
            self._open_lookups.clear()
        for lookup in open_lookups:
            self._unpin_chunks(lookup.chunks)
        self._close_tiers()
        self._lifecycle = _Lifecycle.CLOSED
        logger.info("store closed")

    def _close_tiers(self) -> None:
        # Disk first: closing it drains write-throughs that still read pinned memory slots.
        for tier in (self._disk, self._gpu, self._cpu):
            if tier is not None:
                tier.close()

    def _check_open(self) -> None:
        if getattr(self, "_lifecycle", _Lifecycle.CLOSED) is _Lifecycle.CLOSED:
            raise StoreClosedError("this TieredStore was closed; open a new one")

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()
