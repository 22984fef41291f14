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
  the match leg finds stored chunks anywhere else in the prompt by content (blend segments), then the slices next to
  what both found (the rows of a neighbouring stored chunk the prompt holds token for token). Every planned chunk
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
from kvstore.content.catalog import ContentCatalog, ResidencyCheck
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
from kvstore.plan import Loan, LookupPlan, RetrieveProgress, RetrieveResult, StoreResult
from kvstore.session import Session
from kvstore.stats import StoreStats
from kvstore.store.chunk_writes import ChunkWriter, CutSequence
from kvstore.store.fleet import Fleet
from kvstore.store.ghosts import GhostTable, ResidencyRelay
from kvstore.store.lending import lend_segments
from kvstore.store.local_tiers import LocalTiers
from kvstore.store.lookup_counts import LookupCounts
from kvstore.store.lookup_legs import match_leg, prefix_leg
from kvstore.store.miss_attribution import GoneMatch, gone_match_reason, lookup_misses, retrieve_misses
from kvstore.store.pins import Pin, PinLedger
from kvstore.store.prefetch import Prefetcher
from kvstore.store.retrieve_copies import DiskReads, copy_from_memory, prepared_out
from kvstore.store.segment_loads import SegmentLoader
from kvstore.tiers.base import ContentRecords, TierName, TierStats
from kvstore.tiers.memfd_arena import SealedMemfd
from kvstore.tiers.residency import ResidencyListener

__all__ = ["TieredStore"]

logger = logging.getLogger(__name__)


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
        self._fleet = Fleet(None, None)  # the shared tiers (none until _open_tiers), which cannot pin
        self._tiers = LocalTiers(self._fleet.spilled)  # the local tiers, fastest first (none until _open_tiers)
        self._ledger = PinLedger()
        self._lookup_counts = LookupCounts(self.config.chunk_size)
        self._ghosts = GhostTable()
        self._relay = ResidencyRelay(self._ghosts)  # every local tier's one residency listener
        self._catalog: ContentCatalog | None = None
        self._prefetcher: Prefetcher | None = None
        self._writer = ChunkWriter(self._tiers, self._fleet, None)
        self._loader: SegmentLoader | None = None
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
        rebuild = None
        if TierName.DISK in config.tiers and self._catalog is not None:
            rebuild = self._catalog.start_rebuild()
        self._tiers = LocalTiers.open(config, self.layout, self._fleet, rebuild)
        if rebuild is not None:
            num_indexed = rebuild.finish()
            if num_indexed:
                logger.info("content index rebuilt from %s: %d chunks", config.data_dir, num_indexed)
        self._tiers.watch(self._relay)
        self._writer = ChunkWriter(self._tiers, self._fleet, self._catalog)
        durable, landing = self._tiers.durable, self._tiers.landing
        self._loader = SegmentLoader(
            self.layout,
            self._tiers,
            self._fleet,
            None if durable is None else DiskReads(durable, self.layout, config.chunk_size),
            put_new=self._writer.put_new if config.promote_on_hit else None,
            segmented_prefix=config.enable_segmented_prefix,
        )
        if landing is not None and config.promote_on_hit and (durable or self._fleet.tiers):
            self._prefetcher = Prefetcher(landing, self._ledger, disk=durable)

    def _open_content(self) -> None:
        if not self.config.enable_blend:
            return
        check = ResidencyCheck(
            is_resident=self._is_resident, in_transit=self._in_transit, stored_tokens=self._stored_tokens
        )
        self._catalog = ContentCatalog(
            self.config.chunk_size, check, dedup_content=self.config.enable_dedup_content
        )

    def chunk_bounds(self, tokens: TokenArray) -> list[int]:
        """Where this store cuts ``tokens`` into chunks (``kvstore.keys.chunk_bounds`` with the config's chunk size,
        separator and rule): every part of the store and the server that cuts a sequence cuts it here."""
        config = self.config
        return chunk_bounds(tokens, config.chunk_size, config.chunk_separator, config.chunking)

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
        computed (the tail's keys chain over them), and those that are resident are registered by content together
        with the tail, as one sequence, exactly as a store of the whole sequence would register them.

        Args:
            tokens: the sequence's token ids, from position 0.
            kv: ``[num_layers, 2, len(tokens) - start, num_kv_heads, head_dim]``, the KV of ``tokens[start:]``, in
                the layout's dtype, on the cpu or a GPU.
            start: position of ``kv``'s first token, in ``[0, len(tokens)]``; the chunks that begin before it are
                not written (``kvstore.keys.chunk_bounds``: with a ``chunk_separator`` the boundaries are not
                multiples of ``chunk_size``, so an engine hands over KV from its own block boundary).

        Returns:
            Over the chunks from ``start`` (the ones handed over): each chunk's key, place and outcome (written,
            already held, recorded as a dedup alias, or rejected: every tier pinned full), and their counts.

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
        bounds = self.chunk_bounds(token_array)
        sequence = CutSequence(
            tokens=token_array,
            bounds=bounds,
            keys=keys_at_bounds(self._namespace, token_array, bounds),
            first_index=bisect.bisect_left(bounds[:-1], start),  # the first chunk that begins at or after start
            start=start,
        )
        return self._writer.write(sequence, kv)

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
        partial: bool = True,
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
            partial: with blending, plan slices too (``Segment.is_slice``): next to what the legs found, the
                longest stretch of a neighbouring stored chunk the prompt holds token for token (a document's head
                or tail that was stored in other surroundings; ``kvstore.content.partials``). ``False`` for a caller
                that cannot read slices (a client from before them).

        Raises:
            ConfigError: ``blend=True`` on a store opened without ``enable_blend``.
        """
        self._check_open()
        token_array = as_token_array(tokens)
        catalog = self._catalog
        use_blend = catalog is not None if blend is None else blend
        if use_blend and catalog is None:
            raise ConfigError("lookup(blend=True) needs a store opened with StoreConfig(enable_blend=True)")
        bounds = self.chunk_bounds(token_array)
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
                namespace=self._namespace, separator=self.config.chunk_separator,
                chunking=self.config.chunking, on_gone=on_gone, partial=partial,
            )  # fmt: skip
        plan_id = self._ledger.open_plan(session_id, pins)
        misses = lookup_misses(
            segments, bounds, keys, is_resident=self._is_resident, dropped_by=self._ghosts.dropped_by, gone=gone
        )
        if not repeat:
            self._lookup_counts.add(len(token_array), segments, misses, num_query_chunks=len(bounds) - 1)
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
        tier = self._tiers.pin_fastest(key)
        if tier is not None:
            pins.append((tier, key))
            return tier.name
        return self._fleet.knows(key)

    def _is_resident(self, key: PrefixKey) -> bool:
        return self._tiers.holds(key) or self._fleet.knows(key) is not None

    def _in_transit(self, key: PrefixKey) -> bool:
        return self._tiers.in_transit(key)

    def _stored_tokens(self, key: PrefixKey) -> TokenArray | None:
        record = self._tiers.record(key)
        return None if record is None else record.tokens

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
        assert self._loader is not None, "an open store has its segment loader (_open_tiers)"
        try:
            out = prepared_out(shape, plan.end - start, out, device)
            loads = self._loader.load(plan, pins, out, memory_only=memory_only, start=start, part=part)
            if progress is not None:
                progress.segments_loaded(tuple(loads.loaded))
            copy_from_memory(loads.copies, out.device, progress, shape.num_layers)
        finally:
            if not keep_pins:
                self._unpin(pins)
        loaded = loads.loaded
        fastest = self._tiers.fastest
        if self.config.promote_on_hit and fastest is not None:
            self._tiers.promote([segment.key for segment in loaded if segment.tier is not fastest.name])
        end = loaded[-1].end if loaded else start
        self._lookup_counts.add_dropped(loads.dropped, start)
        return RetrieveResult(
            segments=tuple(loaded),
            num_query_tokens=plan.num_query_tokens,
            kv=out[:, :, : end - start],
            start=start,
            misses=retrieve_misses(plan.misses, loads.dropped, start),
        )

    def lend(self, plan: LookupPlan, *, start: int = 0) -> Loan | None:
        """Where the plan's chunks from ``start`` on lie in the shared cpu arena (``lending``), for a same-host client
        that maps it (``shared_arena``) to copy from; the plan stays open with its pins until ``release``. ``None``
        when some segment is not in that arena (or there is none), or a prefetch of the plan is still running: the
        caller retrieves the plan instead. Never waits (a server answers it on its control threads).

        Raises:
            ConfigError: the plan was already retrieved or released, or its session ended.
            InvalidInputError: ``start`` is outside ``[0, plan.end]``.
        """
        self._check_open()
        if not 0 <= start <= plan.end:
            raise InvalidInputError(f"lend start {start} is outside the plan's [0, {plan.end}]")
        if not plan.ready:  # a disk chunk still landing: a retrieve waits for it, a lend never blocks
            return None
        pins = self._ledger.pins_of(plan.plan_id)
        if pins is None:
            raise ConfigError(
                f"plan {plan.plan_id} was already retrieved or released (or its session ended); call lookup() again"
            )
        return lend_segments(plan, pins, start)

    @property
    def shared_arena(self) -> SealedMemfd | None:
        """The cpu tier's memory file, when it is kept in one (``StoreConfig.cpu_shared_memory``)."""
        landing = self._tiers.landing  # the cpu tier
        return landing.shared if landing is not None else None

    def release(self, plan: LookupPlan) -> None:
        """Drop the pins of a plan that will not be retrieved. Idempotent."""
        self._unpin(self._ledger.take_plan(plan.plan_id) or [])

    def end_session(self, session_id: str) -> None:
        """Release every plan of a session that was not retrieved or released. Idempotent."""
        self._unpin(self._ledger.take_session(session_id))

    def _unpin(self, pins: Sequence[Pin]) -> None:
        for tier, key in pins:
            tier.unpin(key)

    # -- admin --------------------------------------------------------------------------------------------------

    def contains(self, key: PrefixKey) -> list[TierName]:
        """Tiers that hold a chunk, fastest first (shared tiers: as far as this host knows)."""
        held = [tier.name for tier in self._tiers if tier.contains(key)]
        return held + [shared.name for shared in self._fleet.tiers if shared.knows(key)]

    def watch_residency(self, listener: ResidencyListener) -> None:
        """Tell ``listener`` of every chunk that becomes or stops being resident in a local tier, from now on
        (``tiers.residency``: it is called under the tiers' locks, so it must only take note); one listener at a
        time (``SILENT``: stop)."""
        self._relay.watch(listener)

    def resident_records(self) -> Iterator[tuple[TierName, ContentRecords]]:
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
        return self._tiers.require(tier_name(tier)).evict_bytes(num_bytes)

    def flush(self) -> None:
        """Block until every pending disk write is committed and synced, every registration has run, and every
        chunk and directory record queued for the remote was sent (or dropped: the remote is down)."""
        self._check_open()
        if self._tiers.durable is not None:
            self._tiers.durable.flush()
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
        self._fleet.close()  # before the local tiers: its writers may still read borrowed landing slots
        self._tiers.close()

    def _check_open(self) -> None:
        if getattr(self, "_lifecycle", _Lifecycle.CLOSED) is _Lifecycle.CLOSED:
            raise StoreClosedError("this TieredStore was closed; open a new one")

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()
