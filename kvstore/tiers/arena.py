"""A preallocated arena of chunk-sized slots with LRU eviction and pin counts: the body of the cpu and gpu tiers.

Why an arena: a copy into a fresh 32 MiB allocation runs several times slower than a copy into memory that already
exists (measured: docs/design-notes.md#tiers-arena), so the hot path must never allocate. The
arena is one ``uint8`` tensor of ``num_slots * slot_bytes`` allocated once (pinned host memory when CUDA is present,
or device memory); slot ``i`` holds one chunk at byte offset ``i * slot_bytes``, a partial chunk in its first
bytes::

    arena: | slot 0: [L,2,n,H,D] ... pad | slot 1 | slot 2 | ... | slot num_slots-1 |

Invariants:
- a key is in at most one of ``_resident`` (visible) and ``_reserved`` (being filled, invisible);
- a slot index is in exactly one of ``_free_slots``, ``_resident`` or ``_reserved``;
- a slot with ``pins > 0`` is never chosen as a victim;
- a victim's key is in ``_spilling`` from the moment it leaves ``_resident`` until its spill returns, so
  ``in_transit`` can tell a chunk that is being moved to make room from one that is gone.

Threads: any number of callers. ``_slots_lock`` guards ``_resident``, ``_reserved``, ``_free_slots``, pin counts
and the counters; it is held only for bookkeeping, never while copying bytes or calling ``spill``, so a slow copy or
a blocking lower tier cannot stall other callers (and no lock is ever held across tiers).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from kvstore.errors import ConfigError, StorageError, StoreClosedError
from kvstore.keys import PrefixKey
from kvstore.layout import KVLayout
from kvstore.tiers.base import ChunkRecord, ContentRecords, SpillCallback, Tier, TierName, TierStats
from kvstore.tiers.memfd_arena import SealedMemfd, create_shared_arena, memfd_possible
from kvstore.tiers.residency import SILENT, ResidencyListener

__all__ = ["ArenaTier", "FillCallback"]

logger = logging.getLogger(__name__)

FillCallback = Callable[[torch.Tensor], bool]
"""Writes a chunk into the slot view it is given; returns ``False`` when it could not (the slot is then freed)."""

_MIB = 1024 * 1024
_RECORDS_PER_BATCH = 1024  # resident_batches: as the disk tier reads its records


@dataclass(slots=True)
class _Slot:
    """One occupied slot; owned by the arena and mutated only under ``_slots_lock``."""

    index: int
    record: ChunkRecord
    pins: int = 0


@dataclass(slots=True)
class _Counters:
    puts: int = 0
    rejected_puts: int = 0
    evictions: int = 0


class ArenaTier(Tier):
    """Chunk slots in one preallocated tensor, least-recently-used eviction, spill to a lower tier.

    Args:
        name: ``TierName.CPU`` or ``TierName.GPU`` (for stats and messages).
        layout: the KV layout every chunk has.
        chunk_size: tokens per full chunk; a slot holds one full chunk.
        capacity_bytes: arena size; rounded down to whole slots, must hold at least one.
        device: where the arena lives (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
        pin_memory: page-lock a host arena so device copies run at full speed (ignored off the host).
        spill: called with a victim's record and KV view before its slot is reused.
        shared_memory: keep a host arena in a sealed memory file same-host clients can map (``shared``), so a
            retrieve can lend them its pinned slots (``lent_offset``) instead of copying; not with ``pin_memory``.
    """

    def __init__(
        self,
        name: TierName,
        layout: KVLayout,
        chunk_size: int,
        capacity_bytes: int,
        *,
        device: str | torch.device = "cpu",
        pin_memory: bool = False,
        spill: SpillCallback | None = None,
        shared_memory: bool = False,
    ) -> None:
        self.name = name
        self.layout = layout
        self.chunk_size = chunk_size
        self.device = torch.device(device)
        self.slot_bytes = layout.chunk_bytes(chunk_size)
        self.num_slots = capacity_bytes // self.slot_bytes
        if self.num_slots < 1:
            raise ConfigError(
                f"{name} tier capacity_bytes={capacity_bytes} is below one chunk "
                f"({self.slot_bytes / _MIB:.1f} MiB for {layout.describe()} x {chunk_size} tokens); "
                f"raise --{name}-size"
            )
        self.capacity_bytes = self.num_slots * self.slot_bytes
        self._spill = spill
        host_only = self.device.type == "cpu" and not pin_memory
        self.shared = _shared_arena(name, self.capacity_bytes) if shared_memory and host_only else None
        if self.shared is not None:
            self._arena = self.shared.tensor
        else:
            self._arena = torch.empty(
                self.capacity_bytes,
                dtype=torch.uint8,
                device=self.device,
                pin_memory=pin_memory and self.device.type == "cpu",
            )
        # Views of full slots, built once: slicing and reshaping per call costs more than copying a 5.6 MiB chunk
        # on an H200 (measured: docs/design-notes.md#tiers-arena).
        self._full_slot_views = [self._make_view(index, chunk_size) for index in range(self.num_slots)]
        self._slots_lock = threading.Lock()
        self._resident: OrderedDict[PrefixKey, _Slot] = OrderedDict()
        self._reserved: dict[PrefixKey, _Slot] = {}
        self._spilling: set[PrefixKey] = set()
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self._counters = _Counters()
        self._residency = SILENT
        self._closed = False
        logger.info(
            "%s tier: %d slots of %.1f MiB on %s%s",
            name,
            self.num_slots,
            self.slot_bytes / _MIB,
            self.device,
            " (pinned)" if self._arena.is_pinned() else " (shared)" if self.shared is not None else "",
        )

    def slot_view(self, index: int, num_tokens: int) -> torch.Tensor:
        """The KV view of slot ``index`` holding ``num_tokens`` tokens."""
        if num_tokens == self.chunk_size:
            return self._full_slot_views[index]
        return self._make_view(index, num_tokens)

    def _make_view(self, index: int, num_tokens: int) -> torch.Tensor:
        start = index * self.slot_bytes
        raw = self._arena[start : start + self.layout.chunk_bytes(num_tokens)]
        return raw.view(self.layout.dtype.torch_dtype).view(self.layout.chunk_shape(num_tokens))

    def contains(self, key: PrefixKey) -> bool:
        with self._slots_lock:
            return key in self._resident

    def in_transit(self, key: PrefixKey) -> bool:
        """Whether the chunk is being moved for room: spilled out as a victim, or filled into a reserved slot."""
        with self._slots_lock:
            return key in self._spilling or key in self._reserved

    def num_tokens(self, key: PrefixKey) -> int | None:
        with self._slots_lock:
            slot = self._resident.get(key)
            return None if slot is None else slot.record.num_tokens

    def put(self, record: ChunkRecord, kv: torch.Tensor) -> bool:
        def copy_in(view: torch.Tensor) -> bool:
            view.copy_(kv)
            return True

        return self.put_with(record, copy_in)

    def put_with(self, record: ChunkRecord, fill: FillCallback) -> bool:
        """Reserve a slot for ``record`` and let ``fill`` write the KV into it, without an intermediate buffer.

        Used for promotion: the disk tier decodes straight into the slot. The chunk becomes visible only after
        ``fill`` returns ``True``.

        Returns:
            ``True`` when the chunk is resident afterwards (or already was, or another thread is filling it),
            ``False`` when every slot is pinned or ``fill`` failed.
        """
        self._check_open()
        if record.num_tokens > self.chunk_size:
            raise ConfigError(
                f"chunk of {record.num_tokens} tokens exceeds this tier's chunk_size={self.chunk_size}"
            )
        with self._slots_lock:
            if record.key in self._resident:
                self._resident.move_to_end(record.key)
                return True
            if record.key in self._reserved:
                return True
            index, victim = self._take_slot_locked()
            if index is None:
                self._counters.rejected_puts += 1
                return False
            self._reserved[record.key] = _Slot(index=index, record=record)
            if victim is not None:
                self._spilling.add(victim.key)
        filled = False
        try:
            if victim is not None and self._spill is not None:
                self._spill(victim, self.slot_view(index, victim.num_tokens))
            filled = fill(self.slot_view(index, record.num_tokens))
        finally:
            with self._slots_lock:
                if victim is not None:
                    self._spilling.discard(victim.key)
                slot = self._reserved.pop(record.key)
                if filled:
                    self._resident[record.key] = slot
                    self._counters.puts += 1
                    self._residency.stored(self.name, record)
                else:
                    self._free_slots.append(slot.index)
        return filled

    def _take_slot_locked(self) -> tuple[int | None, ChunkRecord | None]:
        """A free slot, or the least recently used unpinned one with its evicted record."""
        if self._free_slots:
            return self._free_slots.pop(), None
        for key, slot in self._resident.items():
            if slot.pins == 0:
                del self._resident[key]
                self._counters.evictions += 1
                self._residency.removed(self.name, (key,))
                return slot.index, slot.record
        return None, None

    def get_into(self, key: PrefixKey, out: torch.Tensor) -> bool:
        slot = self._pin_for_read(key)
        if slot is None:
            return False
        try:
            out.copy_(self.slot_view(slot.index, slot.record.num_tokens))
        finally:
            self.unpin(key)
        return True

    def _pin_for_read(self, key: PrefixKey) -> _Slot | None:
        self._check_open()
        with self._slots_lock:
            slot = self._resident.get(key)
            if slot is None:
                return None
            slot.pins += 1
            self._resident.move_to_end(key)
            return slot

    def view(self, key: PrefixKey) -> torch.Tensor:
        """Zero-copy view of a resident chunk; the caller must hold a pin for as long as it uses the view."""
        with self._slots_lock:
            slot = self._resident.get(key)
            assert slot is not None and slot.pins > 0, (
                "ArenaTier.view needs a pinned resident chunk; pin() first"
            )
            return self.slot_view(slot.index, slot.record.num_tokens)

    def lent_offset(self, key: PrefixKey, num_tokens: int) -> int | None:
        """The byte offset in the arena of a resident chunk's slot, for a client that maps it (``shared``), or
        ``None`` when the chunk holds another number of tokens; the caller must hold a pin for as long as the client
        reads it."""
        with self._slots_lock:
            slot = self._resident.get(key)
            assert slot is not None and slot.pins > 0, "ArenaTier.lent_offset needs a pinned resident chunk"
            return slot.index * self.slot_bytes if slot.record.num_tokens == num_tokens else None

    def record(self, key: PrefixKey) -> ChunkRecord | None:
        with self._slots_lock:
            slot = self._resident.get(key)
            return None if slot is None else slot.record

    def pin(self, key: PrefixKey) -> bool:
        with self._slots_lock:
            slot = self._resident.get(key)
            if slot is None:
                return False
            slot.pins += 1
            return True

    def unpin(self, key: PrefixKey) -> None:
        with self._slots_lock:
            if self._closed:
                return
            slot = self._resident.get(key)
            assert slot is not None and slot.pins > 0, f"unpin of {key.hex()} without a matching pin"
            slot.pins -= 1

    def evict(self, key: PrefixKey) -> bool:
        with self._slots_lock:
            slot = self._resident.get(key)
            if slot is None or slot.pins > 0:
                return False
            del self._resident[key]
            self._free_slots.append(slot.index)
            self._counters.evictions += 1
            self._residency.removed(self.name, (key,))
            return True

    def evict_bytes(self, num_bytes: int) -> int:
        freed = 0
        removed: list[PrefixKey] = []
        with self._slots_lock:
            for key in [key for key, slot in self._resident.items() if slot.pins == 0]:
                if freed >= num_bytes:
                    break
                slot = self._resident.pop(key)
                self._free_slots.append(slot.index)
                self._counters.evictions += 1
                freed += self.layout.chunk_bytes(slot.record.num_tokens)
                removed.append(key)
            if removed:
                self._residency.removed(self.name, removed)
        return freed

    def keys(self) -> list[PrefixKey]:
        with self._slots_lock:
            return list(self._resident)

    def watch(self, listener: ResidencyListener) -> None:
        with self._slots_lock:
            self._residency = listener

    def resident_batches(self) -> Iterator[ContentRecords]:
        with self._slots_lock:
            records = [slot.record for slot in self._resident.values()]
        for first in range(0, len(records), _RECORDS_PER_BATCH):
            yield ContentRecords.of(records[first : first + _RECORDS_PER_BATCH])

    def stats(self) -> TierStats:
        with self._slots_lock:
            used_bytes = sum(self.layout.chunk_bytes(s.record.num_tokens) for s in self._resident.values())
            counters = self._counters
            return TierStats(
                tier=self.name,
                capacity_bytes=self.capacity_bytes,
                used_bytes=used_bytes,
                stored_bytes=used_bytes,
                num_chunks=len(self._resident),
                num_pinned=sum(1 for s in self._resident.values() if s.pins > 0),
                puts=counters.puts,
                rejected_puts=counters.rejected_puts,
                evictions=counters.evictions,
            )

    def close(self) -> None:
        with self._slots_lock:
            if self._closed:
                return
            self._closed = True
            self._resident.clear()
            self._free_slots.clear()
            self._full_slot_views = []
            self._arena = torch.empty(0, dtype=torch.uint8, device=self.device)
            if self.shared is not None:
                self.shared.close_fd()
        logger.info("%s tier closed", self.name)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"{self.name} tier was closed; open a new TieredStore")


def _shared_arena(name: TierName, nbytes: int) -> SealedMemfd | None:
    """A shared arena's memory file, or ``None`` (logged) where the host cannot make one: the tier then lends
    nothing and every retrieve copies, as before."""
    if not memfd_possible():
        return None
    try:
        return create_shared_arena(nbytes)
    except StorageError as exc:
        logger.warning("%s tier: not shared with local clients (%s); retrieves copy", name, exc)
        return None
