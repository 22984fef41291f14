"""``TieredStore``: the public entry point that splits KV into chunks, moves them between tiers and plans lookups.

Data flows one way: engine -> ``TieredStore`` -> tiers (and -> the content catalog). The store wires them:

- **store**: chunks go to the fastest tier that has room; with a disk tier each new chunk is also written through
  asynchronously (the disk writer reads the pinned cpu slot directly, or a staging copy), so the cache survives a
  restart without the caller waiting for zstd or LMDB. With blending on, the committed chunks are then registered
  by content on a worker thread; they stay pinned (shielded from eviction) until that is done. A caller that
  knows the first chunks are held passes ``start=`` and only the KV of the rest. With a remote tier new chunks are
  written through to it too (``remote_write="through"``), and each run of them is published to the fleet directory.
- **eviction demotes**: a tier that needs room spills its least recently used chunk into the next slower tier
  (gpu -> cpu -> disk); a chunk the disk already holds is simply dropped from memory. Under
  ``remote_write="evict"`` what leaves the last local tier goes to the remote (the disk hands over its victims'
  stored frames).
- **the fleet** (``fleet``: the shared tiers, which cannot pin, behind one object): new chunks are written through
  to the remote tier (or reach it as they are evicted), their runs published to the fleet directory; a background
  reader brings other hosts' runs into the content index and the remote tier's key set; lookups plan such chunks
  as ``remote`` segments without asking Valkey.
- **lookup** builds a plan (``kvstore.plan``): the prefix leg walks the prompt's prefix keys (exact segments; a
  missing chunk cuts the prefix, or becomes a gap with segmented prefix; a dedup alias gives a blend segment);
  the match leg finds stored chunks anywhere else in the prompt by content (blend segments). Every planned chunk
  is pinned in the fastest tier holding it; disk-only chunks are prefetched into the cpu tier in the background.
- **retrieve** waits for the plan's prefetches, copies each segment's KV to its place in the caller's buffer (or
  a new tensor), drops the plan's pins and promotes cpu hits into the gpu tier; remote segments no prefetch landed
  are fetched a group per round trip (``remote_reads``) and put into the local tiers.
- **sessions**: a plan belongs to the session that asked for it; ``end_session`` (or a ``Session`` leaving its
  ``with`` block, or being garbage-collected) drops the pins of every plan it did not retrieve.

Threads: any number of callers. Each tier guards its own state, the pin ledger its own, the catalog its own;
``DiskReads`` guards its decode buffer for disk reads into non-contiguous or device buffers. No lock is held
while calling into a tier, so locks never nest across tiers.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import enum
import logging
from collections.abc import Iterator, Sequence
from types import TracebackType

import numpy as np
import numpy.typing as npt
import torch

from kvstore.collector import collector_paused
from kvstore.config import StoreConfig, check_byte_count, tier_name
from kvstore.content.catalog import ContentCatalog, Residency
from kvstore.content.index import Match
from kvstore.errors import ConfigError, InvalidInputError, StoreClosedError
from kvstore.keys import (
    PrefixKey,
    TokenArray,
    as_token_array,
    checked_keys,
    chunk_bounds,
    keys_at_bounds,
)
from kvstore.kv_part import KVPart
from kvstore.layout import KVLayout
from kvstore.misses import Miss, MissReason
from kvstore.plan import LookupPlan, RetrieveProgress, RetrieveResult, Segment, StoreResult
from kvstore.session import Session
from kvstore.stats import StoreStats
from kvstore.store.borrowed_writes import write_borrowing
from kvstore.store.fleet import Fleet
from kvstore.store.ghosts import GhostTable, ResidencyRelay
from kvstore.store.lookup_counts import LookupCounts
from kvstore.store.lookup_legs import match_leg, prefix_leg
from kvstore.store.miss_reasons import GoneMatch, gone_match_reason, lookup_misses, retrieve_misses
from kvstore.store.pins import Pin, PinLedger
from kvstore.store.prefetch import Prefetcher
from kvstore.store.retrieve_copies import DiskReads, copy_from_memory, prepared_out
from kvstore.tiers.arena import ArenaTier
from kvstore.tiers.base import ChunkRecord, ContentRecords, Tier, TierName, TierStats
from kvstore.tiers.cpu import CpuTier
from kvstore.tiers.disk.tier import DiskTier
from kvstore.tiers.disk.tuning import DiskTuning
from kvstore.tiers.gpu import GpuTier
from kvstore.tiers.residency import ResidencyListener

__all__ = ["TieredStore"]

logger = logging.getLogger(__name__)


def _no_op() -> None:
    pass


class _Lifecycle(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


class TieredStore:
    """KV chunks in gpu/cpu/disk tiers, found by prefix key and (with blending on) by content.

    Example::

        layout = KVLayout(model_id="my-model", num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16")
        with TieredStore(layout, StoreConfig(data_dir=Path("kvstore-data"))) as store:
            store.store(tokens, kv)                     # kv: [30, 2, len(tokens), 3, 64] bf16
            plan = store.lookup(tokens + more_tokens)
            result = store.retrieve(plan)               # result.kv: the cached prefix's KV

    Args:
        layout: the model's KV layout; every chunk must have it (a data dir keeps the one it was created with).
        config: tiers, sizes, the data dir and the blend features.
    """

    def __init__(self, layout: KVLayout, config: StoreConfig | None = None) -> None:
        self.layout = layout
        self.config = config or StoreConfig()
        self._namespace = layout.namespace
        self._gpu: GpuTier | None = None
        self._cpu: CpuTier | None = None
        self._disk: DiskTier | None = None
        self._fleet = Fleet(None, None)  # the shared tiers (none until _open_tiers), which cannot pin
        self._tiers: list[Tier] = []  # the local tiers, fastest first
        self._ledger = PinLedger()
        self._lookup_counts = LookupCounts(self.config.chunk_size)
        self._ghosts = GhostTable()
        self._residency = ResidencyRelay(self._ghosts)  # every local tier's one listener
        self._catalog: ContentCatalog | None = None
        self._prefetcher: Prefetcher | None = None
        self._disk_reads: DiskReads | None = None
        try:
            with collector_paused():
                self._open_content()  # first: the disk tier's recovery feeds the content index's rebuild
                self._open_tiers()
        except BaseException:
            self._shutdown()
            raise
        self._lifecycle = _Lifecycle.OPEN
        logger.info(
            "store open: %s, tiers %s, chunk %d tokens%s",
            layout.describe(),
            ",".join(t.value for t in self.config.tiers),
            self.config.chunk_size,
            ", blend" if self._catalog is not None else "",
        )

    def _open_tiers(self) -> None:
        config = self.config
        self._fleet = Fleet.open(config, self.layout, self._catalog)
        if TierName.DISK in config.tiers:
            rebuild = self._catalog.start_rebuild() if self._catalog is not None else None
            self._disk = DiskTier(
                config.data_dir,
                self.layout,
                config.chunk_size,
                config.disk_capacity_bytes,
                zstd_level=config.disk_zstd_level,
                num_codec_threads=config.disk_codec_threads,
                # with a cpu tier, writes borrow its slots (put_borrowed): staging serves only rare spills
                tuning=DiskTuning(preallocate_staging=TierName.CPU not in config.tiers),
                content_records=None if rebuild is None else rebuild.add,  # one pass over the meta records
                on_evict=self._fleet.evicted if self._fleet.writes_on_eviction else None,
            )
            self._disk_reads = DiskReads(self._disk, self.layout, config.chunk_size)
            if rebuild is not None:
                num_indexed = rebuild.finish()
                if num_indexed:
                    logger.info("content index rebuilt from %s: %d chunks", config.data_dir, num_indexed)
        if TierName.CPU in config.tiers:
            self._cpu = CpuTier(self.layout, config.chunk_size, config.cpu_capacity_bytes, spill=self._spill_to_disk)
        if TierName.GPU in config.tiers:
            self._gpu = GpuTier(
                self.layout,
                config.chunk_size,
                config.gpu_capacity_bytes,
                device=config.gpu_device,
                spill=self._spill_to_cpu,
            )
        self._tiers = [tier for tier in (self._gpu, self._cpu, self._disk) if tier is not None]
        for tier in self._tiers:
            tier.watch(self._residency)
        if self._cpu is not None and config.promote_on_hit and (self._disk or self._fleet.tiers):
            self._prefetcher = Prefetcher(self._cpu, self._ledger, disk=self._disk)

    def _open_content(self) -> None:
        if not self.config.enable_blend:
            return
        residency = Residency(is_resident=self._is_resident, in_transit=self._in_transit)
        self._catalog = ContentCatalog(
            self.config.chunk_size, residency, dedup_content=self.config.enable_dedup_content
        )

    # -- demotion ---------------------------------------------------------------------------------------------

    def _spill_to_cpu(self, record: ChunkRecord, kv: torch.Tensor) -> None:
        """gpu victim -> cpu tier (or straight to disk when there is no cpu tier)."""
        if self._cpu is not None:
            self._cpu.put(record, kv)
        else:
            self._spill_to_disk(record, kv)

    def _spill_to_disk(self, record: ChunkRecord, kv: torch.Tensor) -> None:
        """Memory victim -> disk, unless the write-through already put it there (without a disk tier: the fleet's,
        under the ``evict`` write policy)."""
        if self._disk is not None:
            if not self._disk.contains(record.key):
                self._disk.put(record, kv)
        else:
            self._fleet.spilled(record, kv)

    def _chunk_bounds(self, tokens: TokenArray) -> list[int]:
        return chunk_bounds(tokens, self.config.chunk_size, self.config.chunk_separator)

    # -- store ------------------------------------------------------------------------------------------------

    def store(
        self, tokens: Sequence[int] | npt.NDArray[np.integer], kv: torch.Tensor, *, start: int = 0
    ) -> StoreResult:
        """Cache the KV of a token sequence, chunk by chunk.

        With ``start`` a caller that knows the store holds the first chunks (an engine whose lookup found them)
        hands over only the KV of the rest::

            tokens: | chunk 0 | chunk 1 | chunk 2 | chunk 3 | c4 |
                                   ^ start (written: chunks 2, 3 and c4)
            kv:                    | .... chunk 2 | chunk 3 | c4 |   [L, 2, len(tokens) - start, H, D]

        The chunks that begin before ``start`` are never written, resident or not; their prefix keys are still
        computed (the
        tail's keys chain over them), and those that are resident are registered by content together with the
        tail, as one sequence, exactly as a store of the whole sequence would register them.

        Args:
            tokens: the sequence's token ids, from position 0.
            kv: ``[num_layers, 2, len(tokens) - start, num_kv_heads, head_dim]``, the KV of ``tokens[start:]``, in
                the layout's dtype, on the cpu or a GPU.
            start: position of ``kv``'s first token, in ``[0, len(tokens)]``; the chunks that begin before it are
                not written (``kvstore.keys.chunk_bounds``: with a ``chunk_separator`` the boundaries are not
                multiples of ``chunk_size``, so an engine hands over KV from its own block boundary).

        Returns:
            Counted over the chunks from ``start`` (the ones handed over): how many there are, how many were new,
            rejected (every tier pinned full) or recorded as dedup aliases.

        Raises:
            InvalidInputError: the KV does not match the tokens or the layout, or ``start`` is not a chunk
                boundary within the tokens.
        """
        self._check_open()
        token_array = as_token_array(tokens)
        if not 0 <= start <= len(token_array):
            raise InvalidInputError(
                f"store start={start} must lie in [0, len(tokens)={len(token_array)}]; pass the position of the "
                "first token whose KV you send"
            )
        self._check_tail_kv(kv, len(token_array), start)
        bounds = self._chunk_bounds(token_array)
        first_index = bisect.bisect_left(bounds[:-1], start)  # the first chunk that begins at or after start
        keys = keys_at_bounds(self._namespace, token_array, bounds)
        catalog = self._catalog
        # Indexed from the first chunk written, cut where the whole sequence is cut.
        first_start = bounds[first_index]
        dedup = (
            catalog.dedup_targets(
                token_array[first_start:], [bound - first_start for bound in bounds[first_index + 1 :]]
            )
            if catalog is not None
            else []
        )
        committed = [False] * len(keys)  # resident after this call, so its content may be registered
        if catalog is not None:
            for index in range(first_index):  # not written, but registered with the tail as a full store would
                committed[index] = self._is_resident(keys[index])
        shields: list[Pin] = []
        num_new = num_rejected = num_aliased = 0
        new_indexes: list[int] = []
        for index in range(first_index, len(keys)):
            key = keys[index]
            if self._is_local(key):
                committed[index] = True
                continue
            if catalog is not None and catalog.is_alias(key):
                continue
            position = index - first_index
            if position < len(dedup) and (target := dedup[position]) is not None and target.key != key:
                assert catalog is not None
                catalog.add_alias(key, target)
                num_aliased += 1
                continue
            chunk_start, chunk_end = bounds[index], bounds[index + 1]
            parent = keys[index - 1] if index else None
            record = ChunkRecord(
                key=key, source_start=chunk_start, tokens=token_array[chunk_start:chunk_end], parent_key=parent
            )
            tier = self._put_new_chunk(record, kv[:, :, chunk_start - start : chunk_end - start])
            if tier is None:
                num_rejected += 1
                continue
            num_new += 1
            new_indexes.append(index)
            committed[index] = True
            if catalog is not None and tier.pin(key):
                shields.append((tier, key))  # shielded from eviction until its registration has run
        num_chunks = len(keys) - first_index
        if num_rejected:
            logger.warning("store: %d of %d chunks rejected, every tier is pinned full", num_rejected, num_chunks)
        if catalog is not None:
            self._register_runs(catalog, token_array, keys, bounds, committed, shields)
        self._fleet.stored(token_array, keys, bounds, new_indexes)
        return StoreResult(
            num_chunks=num_chunks,
            num_new_chunks=num_new,
            num_rejected_chunks=num_rejected,
            num_aliased_chunks=num_aliased,
        )

    def _check_tail_kv(self, kv: torch.Tensor, num_tokens: int, start: int) -> None:
        """``kv`` must be the layout's KV of ``tokens[start:]``, on a device the tiers copy from."""
        try:
            self.layout.check_kv(kv, num_tokens - start)
        except InvalidInputError as exc:
            if not start:
                raise
            raise InvalidInputError(
                f"{exc}; with start={start}, kv holds only tokens[{start}:], {num_tokens - start} of {num_tokens}"
            ) from None
        if kv.device.type not in ("cpu", "cuda"):
            raise InvalidInputError(f"kv is on device {kv.device}; hand over a cpu or cuda tensor")

    def _put_new_chunk(self, record: ChunkRecord, kv: torch.Tensor) -> Tier | None:
        """Put into the fastest tier with room, then write through to disk off the caller's path."""
        for tier in self._tiers:
            if not tier.put(record, kv):
                continue
            disk = self._disk
            if disk is not None and tier is not disk:  # off the caller's path, borrowing the cpu slot
                write_borrowing(tier, record, kv, put=disk.put, put_borrowed=disk.put_borrowed)
            self._fleet.wrote(tier, record, kv)
            return tier
        return None

    def _register_runs(
        self,
        catalog: ContentCatalog,
        tokens: TokenArray,
        keys: Sequence[PrefixKey],
        bounds: Sequence[int],
        committed: Sequence[bool],
        shields: Sequence[Pin],
    ) -> None:
        """Queue each run of consecutive committed chunks for content registration; the last run drops the shields."""
        runs: list[tuple[int, int]] = []
        for index, is_committed in enumerate(committed):
            if not is_committed:
                continue
            if runs and runs[-1][1] == index:
                runs[-1] = (runs[-1][0], index + 1)
            else:
                runs.append((index, index + 1))
        if not runs:
            self._unpin(shields)
            return
        for position, (first, last) in enumerate(runs):
            start, end = bounds[first], bounds[last]
            # Runs register in order, so the last one's completion means every shield can go.
            on_done = (lambda: self._unpin(shields)) if position == len(runs) - 1 else _no_op
            chunk_ends = [bound - start for bound in bounds[first + 1 : last + 1]]
            catalog.register(tokens[start:end], keys[first:last], start, on_done, chunk_ends=chunk_ends)

    # -- lookup -----------------------------------------------------------------------------------------------

    def session(self, session_id: str | None = None) -> Session:
        """A session whose end (``close``, a ``with`` block, or garbage collection) releases its plans."""
        self._check_open()
        return Session(self, session_id)

    def lookup(
        self,
        tokens: Sequence[int] | npt.NDArray[np.integer],
        *,
        session_id: str | None = None,
        blend: bool | None = None,
        repeat: bool = False,
    ) -> LookupPlan:
        """Plan a prompt: which ranges have cached KV (exact or to blend), where it is, what must be computed.

        The plan's chunks are pinned until ``retrieve``, ``release`` or ``end_session(session_id)``; disk-only
        chunks start moving into the cpu tier in the background (``plan.ready`` / ``plan.wait()``).

        Args:
            tokens: the prompt's token ids.
            session_id: the session the plan belongs to (``None``: only retrieve or release free it).
            blend: include blend segments (match leg, dedup aliases); defaults to ``config.enable_blend``.
            repeat: the caller looked this prompt up before for the same request (an engine's scheduler probes,
                then its worker plans again): planned as usual, but not counted again in the hit and miss counts
                (``stats().lookups``, each tier's hits), which count requests.

        Raises:
            ConfigError: ``blend=True`` on a store opened without ``enable_blend``.
        """
        self._check_open()
        token_array = as_token_array(tokens)
        catalog = self._catalog
        use_blend = catalog is not None if blend is None else blend
        if use_blend and catalog is None:
            raise ConfigError("lookup(blend=True) needs a store opened with StoreConfig(enable_blend=True)")
        bounds = self._chunk_bounds(token_array)
        keys = keys_at_bounds(self._namespace, token_array, bounds)
        pins: list[Pin] = []

        def pin(key: PrefixKey) -> TierName | None:
            return self._pin_fastest(key, pins)

        segmented = self.config.enable_segmented_prefix
        segments = prefix_leg(keys, bounds, pin, catalog if use_blend else None, segmented_prefix=segmented)
        gone: list[GoneMatch] = []

        def on_gone(found: Match, removed: bool) -> None:
            reason = gone_match_reason(self._ghosts.dropped_by(found.key), removed=removed)
            gone.append(GoneMatch(found.query_start, found.query_start + found.num_tokens, reason))

        if use_blend:
            assert catalog is not None
            segments = match_leg(
                token_array, keys, bounds, segments, catalog, pin,
                namespace=self._namespace, separator=self.config.chunk_separator, on_gone=on_gone,
            )  # fmt: skip
        plan_id = self._ledger.open_plan(session_id, pins)
        misses = lookup_misses(
            segments, bounds, keys, is_resident=self._is_resident, dropped_by=self._ghosts.dropped_by, gone=gone
        )
        if not repeat:
            self._lookup_counts.add(len(token_array), segments, misses)
        prefetches: tuple[concurrent.futures.Future[bool], ...] = ()
        if self._prefetcher is not None:
            prefetcher = self._prefetcher
            prefetches = tuple(
                prefetcher.start(plan_id, segment.key) for segment in segments if segment.tier is TierName.DISK
            )
            for shared in self._fleet.tiers:
                shared_keys = [segment.key for segment in segments if segment.tier is shared.name]
                if shared_keys:
                    prefetches += tuple(prefetcher.start_shared(plan_id, shared, shared_keys))
        return LookupPlan(
            plan_id=plan_id,
            session_id=session_id,
            num_query_tokens=len(token_array),
            segments=tuple(segments),
            misses=misses,
            prefetches=prefetches,
        )

    def _pin_fastest(self, key: PrefixKey, pins: list[Pin]) -> TierName | None:
        """Pin the chunk in the fastest local tier holding it; a chunk only a shared tier holds is planned unpinned."""
        for tier in self._tiers:
            if tier.pin(key):
                pins.append((tier, key))
                return tier.name
        return self._fleet.knows(key)

    def _is_local(self, key: PrefixKey) -> bool:
        return any(tier.contains(key) for tier in self._tiers)

    def _is_resident(self, key: PrefixKey) -> bool:
        return self._is_local(key) or self._fleet.knows(key) is not None

    def _in_transit(self, key: PrefixKey) -> bool:
        return any(isinstance(tier, ArenaTier) and tier.in_transit(key) for tier in self._tiers)

    # -- retrieve / release -------------------------------------------------------------------------------------

    def retrieve(
        self,
        plan: LookupPlan,
        out: torch.Tensor | None = None,
        *,
        device: str | torch.device = "cpu",
        progress: RetrieveProgress | None = None,
        memory_only: bool = False,
        start: int = 0,
        part: KVPart | None = None,
        keep_pins: bool = False,
    ) -> RetrieveResult:
        """Load the KV of a plan's segments to their places in the prompt, then release the plan's pins.

        Args:
            plan: from ``lookup``; each plan is retrieved (or released) once.
            out: a buffer ``[num_layers, 2, >= plan.end - start, num_kv_heads, head_dim]`` of the layout's dtype
                on any device, token ``start + i`` at index ``i``; gaps are left untouched. When omitted a tensor
                is allocated on ``device``.
            device: where to allocate when ``out`` is omitted.
            progress: when given, the chunks held in memory tiers are copied a few layers at a time (every
                chunk's layers 0-3, then 4-7, ...) and ``progress`` hears of each layer (``RetrieveProgress``): a
                layerwise prefill starts computing before the last layer has landed. Without it each chunk is
                copied whole.
            memory_only: serve only the segments a memory tier holds now (a finished prefetch counts); the
                others become gaps at once, without waiting for the disk. Their prefetches go on and leave the
                chunks in the cpu tier for the next lookup. For a caller that recomputes faster than the disk
                reads (``kvstore.blend.load_cost``).
            start: the caller already holds the prompt's tokens ``[0, start)`` (an engine's own prefix cache): only
                ``[start, plan.end)`` is loaded, and ``out`` holds only those. Segments that end by ``start`` are
                not read; one that straddles it is read whole and its tail copied.
            part: load only this part of every chunk (a tensor- or pipeline-parallel rank's layers and KV heads):
                ``out`` is shaped by it (``KVPart.shape_layout``); a disk chunk is decoded whole and its part copied.
            keep_pins: leave the plan open with its pins (a plan several ranks retrieve by parts: the server
                releases it once every part is done).

        Returns:
            The segments loaded and the KV (a view of ``out`` when given). A chunk that fails to load (corrupt on
            disk) becomes a gap; without segmented prefix the exact segments after it are dropped too.

        Raises:
            ConfigError: the plan was already retrieved or released, or its session ended.
            InvalidInputError: ``out`` has the wrong shape or dtype, or ``start`` is outside ``[0, plan.end]``.
        """
        self._check_open()
        if not 0 <= start <= plan.end:
            raise InvalidInputError(f"retrieve start {start} is outside the plan's [0, {plan.end}]")
        if not memory_only:
            plan.wait()
        pins = self._ledger.pins_of(plan.plan_id) if keep_pins else self._ledger.take_plan(plan.plan_id)
        if pins is None:
            raise ConfigError(
                f"plan {plan.plan_id} was already retrieved or released (or its session ended); call lookup() again"
            )
        if part is not None:
            part.check(self.layout)
        shape = self.layout if part is None else part.shape_layout(self.layout)
        loaded: list[Segment] = []
        dropped: list[Miss] = []
        try:
            out = prepared_out(shape, plan.end - start, out, device)
            copies = self._load_segments(
                plan, pins, out, loaded, dropped, memory_only=memory_only, start=start, part=part
            )
            if progress is not None:
                progress.segments_loaded(tuple(loaded))
            copy_from_memory(copies, out.device, progress, shape.num_layers)
        finally:
            if not keep_pins:
                self._unpin(pins)
        if self.config.promote_on_hit and self._gpu is not None:
            self._promote_to_gpu([segment for segment in loaded if segment.tier is not TierName.GPU])
        end = loaded[-1].end if loaded else start
        self._lookup_counts.add_dropped(dropped, start)
        return RetrieveResult(
            segments=tuple(loaded),
            num_query_tokens=plan.num_query_tokens,
            kv=out[:, :, : end - start],
            start=start,
            misses=retrieve_misses(plan.misses, dropped, start),
        )

    def _load_segments(
        self,
        plan: LookupPlan,
        pins: Sequence[Pin],
        out: torch.Tensor,
        loaded: list[Segment],
        dropped: list[Miss],
        *,
        memory_only: bool,
        start: int,
        part: KVPart | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Decode the plan's disk chunks into ``out`` (unless ``memory_only``) and append every segment that will
        be served to ``loaded``, and every other one to ``dropped`` with its reason; ``out`` begins at token
        ``start``, and segments ending by it are skipped.

        Returns the ``(source, place in out)`` pairs still to be copied: pinned chunk views of the memory tiers, and
        the tail of a decoded chunk that straddles ``start``. Those copies cannot fail, so the segments are final
        before any of them runs. With ``part`` every source is the part's view of its chunk (``out`` is shaped by
        the part) and disk chunks are decoded whole beside ``out``.
        """

        def sliced(chunk: torch.Tensor) -> torch.Tensor:
            return chunk if part is None else part.of(chunk)

        landed = {key for tier, key in pins if tier is self._cpu}
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        prefix_cut = False
        shared_reads = self._fleet.reads(plan, landed)
        for segment in plan.segments:
            if segment.end <= start:
                continue
            if segment.exact and prefix_cut:
                dropped.append(Miss(segment.start, segment.end, MissReason.BEHIND_GAP))
                continue
            held = max(0, start - segment.start)  # the segment's leading tokens the caller already holds
            target = out[:, :, segment.start + held - start : segment.end - start]
            tier = self._cpu if segment.key in landed else self._local_tier(segment.tier)
            if isinstance(tier, ArenaTier):
                view = tier.view(segment.key)
                # a copy must never broadcast one token's KV over a longer segment
                if view.shape[2] == segment.num_tokens:
                    copies.append((sliced(view)[:, :, held:], target))
                    loaded.append(segment)
                    continue
                logger.warning("retrieve: chunk %s holds %d tokens, its plan says %d (a directory or index entry "
                               "of another length); tokens %d-%d become a gap", segment.key.hex(), view.shape[2],
                               segment.num_tokens, segment.start, segment.end)  # fmt: skip
                self._fleet.count_inconsistent(segment)  # a shared chunk a prefetch landed
                prefix_cut = segment.exact and not self.config.enable_segmented_prefix
                dropped.append(Miss(segment.start, segment.end, MissReason.CHECKSUM))
                continue
            if memory_only:  # left to the caller to compute, as a failed load is
                prefix_cut = segment.exact and not self.config.enable_segmented_prefix
                dropped.append(Miss(segment.start, segment.end, MissReason.DISK_SLOWER))
                continue
            place = target if held == 0 and part is None else self._whole_chunk(segment, out)
            # a chunk decoded whole beside out: its (part's) tail still to copy
            tail = [(sliced(place)[:, :, held:], target)] if place is not target else []
            reason = MissReason.CHECKSUM  # a pinned disk chunk that fails to load failed its checks
            if shared_reads is not None and shared_reads.serves(segment):
                record = shared_reads.load_into(segment.key, place)
                if not isinstance(record, MissReason):
                    loaded.append(segment)
                    copies += tail
                    if self.config.promote_on_hit:
                        self._put_new_chunk(record, place)  # into the local tiers (the shared one knows it)
                    continue
                reason = record
            elif self._disk_reads is not None and self._disk_reads.load_into(segment.key, segment.num_tokens, place):
                loaded.append(segment)
                copies += tail
                continue
            # A remote chunk Valkey evicted is an ordinary miss (the remote tier logs outages and corruption).
            logger.log(logging.DEBUG if segment.tier is TierName.REMOTE else logging.WARNING,
                       "retrieve: chunk %s failed to load from the %s tier; tokens %d-%d become a gap",
                       segment.key.hex(), segment.tier.value, segment.start, segment.end)  # fmt: skip
            prefix_cut = segment.exact and not self.config.enable_segmented_prefix
            dropped.append(Miss(segment.start, segment.end, reason))
        return copies

    def _whole_chunk(self, segment: Segment, out: torch.Tensor) -> torch.Tensor:
        """Room to decode a chunk whole beside ``out``, when only its tail belongs there."""
        return torch.empty(self.layout.chunk_shape(segment.num_tokens), dtype=out.dtype, device=out.device)

    def _local_tier(self, name: TierName) -> Tier | None:
        return next((tier for tier in self._tiers if tier.name is name), None)

    def release(self, plan: LookupPlan) -> None:
        """Drop the pins of a plan that will not be retrieved. Idempotent."""
        self._unpin(self._ledger.take_plan(plan.plan_id) or [])

    def end_session(self, session_id: str) -> None:
        """Release every plan of a session that was not retrieved or released. Idempotent."""
        self._unpin(self._ledger.take_session(session_id))

    def _unpin(self, pins: Sequence[Pin]) -> None:
        for tier, key in pins:
            tier.unpin(key)

    def _promote_to_gpu(self, segments: Sequence[Segment]) -> None:
        """Copy retrieved chunks that sit in the cpu tier into the gpu tier (after the plan's pins are gone, so
        the gpu tier can evict its own cold chunks to make room)."""
        assert self._gpu is not None
        for segment in segments:
            key = segment.key
            if self._cpu is None or self._gpu.contains(key) or not self._cpu.pin(key):
                continue
            try:
                record = self._cpu.record(key)
                if record is not None:
                    self._gpu.put(record, self._cpu.view(key))
            finally:
                self._cpu.unpin(key)

    # -- admin --------------------------------------------------------------------------------------------------

    def contains(self, key: PrefixKey) -> list[TierName]:
        """Tiers that hold a chunk, fastest first (shared tiers: as far as this host knows)."""
        held = [tier.name for tier in self._tiers if tier.contains(key)]
        return held + [shared.name for shared in self._fleet.tiers if shared.knows(key)]

    def watch_residency(self, listener: ResidencyListener) -> None:
        """Tell ``listener`` of every chunk that becomes or stops being resident in a local tier, from now on
        (``tiers.residency``: it is called under the tiers' locks, so it must only take note); one listener at a
        time (``SILENT``: stop)."""
        self._residency.watch(listener)

    def residency(self) -> Iterator[tuple[TierName, ContentRecords]]:
        """Every chunk resident in a local tier, tier by tier and a batch of records at a time (for a listener that
        starts late: a chunk that comes or goes meanwhile may be yielded or not, and its listener call settles
        it)."""
        for tier in self._tiers:
            for records in tier.resident_batches():
                yield tier.name, records

    def resident_keys(self) -> Iterator[tuple[TierName, list[PrefixKey]]]:
        """The keys resident in each local tier (from the tiers' memory: no disk read), for a residency snapshot
        without records."""
        for tier in self._tiers:
            yield tier.name, tier.keys()

    def evict(self, keys: Sequence[PrefixKey]) -> int:
        """Drop chunks from every local tier (pinned copies stay; the remote is the fleet's, and Valkey evicts
        there). Returns how many chunk copies were dropped.

        Raises:
            InvalidInputError: a key is not a 16-byte chunk key.
        """
        self._check_open()
        return sum(tier.evict(key) for key in checked_keys(keys) for tier in self._tiers)

    def evict_bytes(self, num_bytes: int, tier: TierName | str) -> int:
        """Free ``num_bytes`` of one tier (``"cpu"`` or ``TierName.CPU``), least recently used first, without
        demoting. Returns bytes freed.

        Raises:
            InvalidInputError: ``num_bytes`` is not a non-negative whole number.
            ConfigError: the store has no such tier.
        """
        self._check_open()
        check_byte_count(num_bytes)
        return self._tier(tier_name(tier)).evict_bytes(num_bytes)

    def flush(self) -> None:
        """Block until every pending disk write is committed and synced, every registration has run, and every
        chunk and directory record queued for the remote was sent (or dropped: the remote is down)."""
        self._check_open()
        if self._disk is not None:
            self._disk.flush()
        if self._catalog is not None:
            self._catalog.sync()
        self._fleet.flush()

    def stats(self) -> StoreStats:
        return StoreStats(
            tiers=tuple(self._lookup_counts.apply(stats) for stats in self._tier_stats()),
            num_open_plans=self._ledger.num_open_plans,
            num_sessions=self._ledger.num_sessions,
            catalog=self._catalog.stats() if self._catalog is not None else None,
            remote=self._fleet.remote_stats(),
            lookups=self._lookup_counts.totals(),
        )

    def _tier_stats(self) -> list[TierStats]:
        return [*(tier.stats() for tier in self._tiers), *self._fleet.stats()]

    def sync_directory(self) -> int:
        """Read the fleet directory now instead of waiting for the background reader; returns the runs read (0
        without a remote tier)."""
        self._check_open()
        return self._fleet.sync_now()

    def _tier(self, name: TierName) -> Tier:
        for tier in self._tiers:
            if tier.name is name:
                return tier
        raise ConfigError(f"this store has no {name.value} tier (tiers: {','.join(t.name.value for t in self._tiers)})")

    # -- lifecycle ----------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Release open plans, finish registrations and pending disk writes, close the tiers. Idempotent."""
        if getattr(self, "_lifecycle", _Lifecycle.CLOSED) is _Lifecycle.CLOSED:
            return
        self._lifecycle = _Lifecycle.CLOSED
        self._shutdown()
        logger.info("store closed")

    def _shutdown(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.shutdown()
        self._fleet.stop_reading()
        if self._catalog is not None:
            self._catalog.close()  # its last completions drop shields: tiers must still be open
        self._unpin(self._ledger.take_all())
        self._fleet.close()  # before the cpu tier: its writers may still read borrowed cpu slots
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
