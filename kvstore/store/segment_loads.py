"""Which of a plan's segments a retrieve serves, and from where: memory views to copy, disk and shared chunks decoded.

A retrieve first settles every segment: a memory tier's pinned view is queued for a copy, a disk or shared chunk is
decoded into the caller's buffer now (unless ``memory_only``), and a chunk that cannot be served becomes a miss with
its reason (``MissReason``). Only then do the queued copies run (``retrieve_copies.copy_from_memory``): they cannot
fail, so the segments are final before any of them starts. A slice (``Segment.is_slice``) copies only its rows of the
chunk: from a memory tier's view, or from the chunk decoded whole beside the caller's buffer. Without segmented
prefix a failed exact segment cuts the prefix, and every exact segment after it is dropped as ``behind_gap``.

Threads: any number of retrieves; ``SegmentLoader`` holds no state of its own (``DiskReads`` guards its scratch
buffer, each tier its own).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvstore.kv_part import KVPart
from kvstore.layout import KVLayout
from kvstore.misses import Miss, MissReason
from kvstore.plan import LookupPlan, Segment
from kvstore.store.fleet import Fleet
from kvstore.store.local_tiers import LocalTiers
from kvstore.store.pins import Pin
from kvstore.store.remote_reads import RemoteReads
from kvstore.store.retrieve_copies import DiskReads
from kvstore.tiers.arena import ArenaTier
from kvstore.tiers.base import ChunkRecord, Tier, TierName

__all__ = ["SegmentLoader", "SegmentLoads"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SegmentLoads:
    """A retrieve's settled segments (one owner: the retrieve that built them).

    Attributes:
        loaded: the segments served, in plan order.
        dropped: the planned ranges not served, each with its reason.
        copies: the ``(source, place in out)`` copies still to run: pinned chunk views of the memory tiers, and
            the tail of a chunk decoded whole beside ``out``.
    """

    loaded: list[Segment] = field(default_factory=list)
    dropped: list[Miss] = field(default_factory=list)
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Placement:
    """Where one segment's KV goes: ``target`` in ``out``, or ``place`` (a chunk decoded whole beside ``out``)
    whose ``rows`` are then copied to ``target``; ``part`` slices each source.

    ``rows``: the chunk's rows the target takes, ``[offset + held, offset + num_tokens)``: a slice's rows, less the
    leading tokens the caller already holds (``held``)."""

    target: torch.Tensor
    place: torch.Tensor
    rows: slice
    part: KVPart | None

    def sliced(self, chunk: torch.Tensor) -> torch.Tensor:
        """The rows and part of a whole chunk the target takes."""
        return (chunk if self.part is None else self.part.of(chunk))[:, :, self.rows]

    def tail(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The copy a chunk decoded whole beside ``out`` still needs (none when it was decoded in place)."""
        return [(self.sliced(self.place), self.target)] if self.place is not self.target else []


class SegmentLoader:
    """Settles a retrieve's segments against the store's tiers.

    Args:
        layout: the store's KV layout.
        tiers: the local tiers.
        fleet: the shared tiers.
        disk_reads: the durable tier's reads into any buffer (``None``: no durable tier).
        put_new: puts a chunk read from a shared tier into the local tiers (``None``: no promotion on a hit).
        segmented_prefix: a failed exact segment leaves a gap instead of cutting the prefix.
    """

    def __init__(
        self,
        layout: KVLayout,
        tiers: LocalTiers,
        fleet: Fleet,
        disk_reads: DiskReads | None,
        *,
        put_new: Callable[[ChunkRecord, torch.Tensor], Tier | None] | None,
        segmented_prefix: bool,
    ) -> None:
        self._layout = layout
        self._tiers = tiers
        self._fleet = fleet
        self._disk_reads = disk_reads
        self._put_new = put_new
        self._segmented_prefix = segmented_prefix

    def load(
        self,
        plan: LookupPlan,
        pins: Sequence[Pin],
        out: torch.Tensor,
        *,
        memory_only: bool,
        start: int,
        part: KVPart | None = None,
    ) -> SegmentLoads:
        """Settle the plan's segments from ``start`` on: ``out`` begins at token ``start``, and segments ending by
        it are skipped. With ``part`` every source is the part's view of its chunk (``out`` is shaped by the part)
        and disk chunks are decoded whole beside ``out``."""
        landing = self._tiers.landing
        landed = {key for tier, key in pins if tier is landing}
        shared_reads = self._fleet.reads(plan, landed)
        loads = SegmentLoads()
        prefix_cut = False
        for segment in plan.segments:
            if segment.end <= start:
                continue
            if segment.exact and prefix_cut:
                loads.dropped.append(Miss(segment.start, segment.end, MissReason.BEHIND_GAP))
                continue
            held = max(0, start - segment.start)  # the segment's leading tokens the caller already holds
            target = out[:, :, segment.start + held - start : segment.end - start]
            rows = slice(segment.offset + held, segment.offset + segment.num_tokens)
            tier = landing if segment.key in landed else self._tiers.named(segment.tier)
            if isinstance(tier, ArenaTier):
                placement = _Placement(target=target, place=target, rows=rows, part=part)
                reason = self._from_memory(tier, segment, placement, loads)
            elif memory_only:  # left to the caller to compute, as a failed load is
                reason = MissReason.DISK_SLOWER
            else:
                in_place = held == 0 and part is None and not segment.is_slice
                place = target if in_place else self._whole_chunk(segment, out)
                placement = _Placement(target=target, place=place, rows=rows, part=part)
                reason = self._from_storage(segment, placement, shared_reads, loads)
            if reason is not None:
                prefix_cut = segment.exact and not self._segmented_prefix
                loads.dropped.append(Miss(segment.start, segment.end, reason))
        return loads

    def _from_memory(
        self, tier: ArenaTier, segment: Segment, placement: _Placement, loads: SegmentLoads
    ) -> MissReason | None:
        """Queue the copy of a pinned memory chunk; ``CHECKSUM`` when it holds another length than planned."""
        view = tier.view(segment.key)
        # a copy must never broadcast one token's KV over a longer segment
        if view.shape[2] == segment.stored_tokens:
            loads.copies.append((placement.sliced(view), placement.target))
            loads.loaded.append(segment)
            return None
        logger.warning("retrieve: chunk %s holds %d tokens, its plan says %d (a directory or index entry "
                       "of another length); tokens %d-%d become a gap", segment.key.hex(), view.shape[2],
                       segment.stored_tokens, segment.start, segment.end)  # fmt: skip
        self._fleet.count_inconsistent(segment)  # a shared chunk a prefetch landed
        return MissReason.CHECKSUM

    def _from_storage(
        self, segment: Segment, placement: _Placement, shared_reads: RemoteReads | None, loads: SegmentLoads
    ) -> MissReason | None:
        """Decode a shared or disk chunk into its place now; the reason it failed otherwise."""
        reason = MissReason.CHECKSUM  # a pinned disk chunk that fails to load failed its checks
        if shared_reads is not None and shared_reads.serves(segment):
            record = shared_reads.load_into(segment.key, placement.place)
            if not isinstance(record, MissReason):
                loads.loaded.append(segment)
                loads.copies += placement.tail()
                if self._put_new is not None:
                    self._put_new(record, placement.place)  # into the local tiers (the shared one knows it)
                return None
            reason = record
        elif self._disk_reads is not None and self._disk_reads.load_into(
            segment.key, segment.stored_tokens, placement.place
        ):
            loads.loaded.append(segment)
            loads.copies += placement.tail()
            return None
        # A remote chunk Valkey evicted is an ordinary miss (the remote tier logs outages and corruption).
        logger.log(logging.DEBUG if segment.tier is TierName.REMOTE else logging.WARNING,
                   "retrieve: chunk %s failed to load from the %s tier; tokens %d-%d become a gap",
                   segment.key.hex(), segment.tier.value, segment.start, segment.end)  # fmt: skip
        return reason

    def _whole_chunk(self, segment: Segment, out: torch.Tensor) -> torch.Tensor:
        """Room to decode a chunk whole beside ``out``, when only some of its rows belong there."""
        return torch.empty(self._layout.chunk_shape(segment.stored_tokens), dtype=out.dtype, device=out.device)
