"""The disk tier's in-memory state: an LRU index of resident chunks, pins, writes in flight and counters.

At open it is rebuilt from the ``meta`` sub-database, so a restart keeps both the chunks and their LRU order:
the recovered chunks stay in arrays (``RecoveredRows``, ordered by last access) until they are used, and the chunks
used since the open are ``IndexEntry`` objects in an ``OrderedDict`` from least to most recently used, all of
them more recent than any recovered row (a million-chunk open builds no object per chunk). A chunk is resident
from the moment ``admit`` accepts its write: until the writer commits it the entry is *pending* -- it carries the
bytes being written (read-your-writes) and an upper bound of its stored size, and it is never a victim.

Invariants (under ``_lock``):
- a key is in ``_entries`` or in ``_recovered``, never both; recovered rows are committed and never pending.
- ``_stored_bytes`` is the sum of ``stored_bytes`` of committed entries and recovered rows;
  ``_pending_bound_bytes`` the sum of the stored-size bounds of pending ones; ``_pinned_stored_bytes`` the stored
  bytes of committed pinned entries and rows; ``_num_pinned`` the entries and rows with pins (so ``stats`` is O(1)).
- a pending entry or one with ``num_pins > 0`` is never removed by ``take_victims`` or ``evict``.
- a ``PendingWrite``'s bytes are released by the writer only after ``wait_for_readers`` (no copy in flight).

Threads: callers and the disk writer. ``_lock`` guards every field. Two conditions on it: ``_readers_done``
wakes the writer when the last copy out of a pending write finishes (``wait_for_readers``), ``_pending_done``
wakes a caller that ``admit`` holds back while writes in flight fill the capacity. Waiting on a condition
releases the lock; nothing else blocks under it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
import numpy.typing as npt

from kvstore.keys import PrefixKey
from kvstore.tiers.base import ChunkRecord, TierName, TierStats
from kvstore.tiers.disk.entries import Admission, DiskCounters, IndexEntry, PendingWrite, ReadTicket
from kvstore.tiers.disk.recovered import RecoveredChunks, RecoveredRows
from kvstore.tiers.residency import SILENT, ResidencyListener

__all__ = ["DiskState"]


class DiskState:
    """LRU index of the chunks in one data dir. Thread-safe.

    Args:
        capacity_bytes: hard cap on stored bytes.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._readers_done = threading.Condition(self._lock)
        self._pending_done = threading.Condition(self._lock)
        self._entries: OrderedDict[PrefixKey, IndexEntry] = OrderedDict()
        self._recovered = RecoveredRows(RecoveredChunks.concatenate([]))
        self._stored_bytes = 0
        self._raw_bytes = 0
        self._pending_bound_bytes = 0
        self._pinned_stored_bytes = 0
        self._num_pinned = 0
        self._dirty_access: dict[PrefixKey, int] = {}
        self._counters = DiskCounters()
        self._residency = SILENT

    def watch(self, listener: ResidencyListener) -> None:
        """Tell ``listener`` of every chunk admitted (resident from then on) or removed, under the lock."""
        with self._lock:
            self._residency = listener

    def load(self, chunks: RecoveredChunks) -> None:
        """Fill the index from the data dir's meta records (at open, before any other call)."""
        with self._lock:
            assert not self._entries and not self._recovered, "DiskState.load after use: opening wiring"
            self._recovered = RecoveredRows(chunks)
            self._stored_bytes += self._recovered.total_stored_bytes
            self._raw_bytes += self._recovered.total_raw_bytes

    # -- queries ---------------------------------------------------------------------------------------------

    def contains(self, key: PrefixKey) -> bool:
        with self._lock:
            return key in self._entries or key in self._recovered

    def resident_mask(self, keys: list[PrefixKey]) -> npt.NDArray[np.bool_]:
        """Which of ``keys`` are resident (one lock round for a batch)."""
        with self._lock:
            mask = self._recovered.contains_many(keys)
            if self._entries:
                mask |= np.fromiter(map(self._entries.__contains__, keys), dtype=np.bool_, count=len(keys))
            return mask

    def num_tokens(self, key: PrefixKey) -> int | None:
        with self._lock:
            entry = self._entries.get(key)
            return self._recovered.num_tokens(key) if entry is None else entry.num_tokens

    def pending_record(self, key: PrefixKey) -> ChunkRecord | None:
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None or entry.pending is None else entry.pending.record

    def pending_records(self) -> list[ChunkRecord]:
        """The records of the chunks admitted and not yet committed (resident, but not in LMDB yet)."""
        with self._lock:
            return [entry.pending.record for entry in self._entries.values() if entry.pending is not None]

    def keys(self) -> list[PrefixKey]:
        """Resident keys, least recently used first."""
        with self._lock:
            return self._recovered.keys() + list(self._entries)

    def access_range_ns(self) -> tuple[int | None, int | None]:
        """Oldest and newest last-access time of resident chunks."""
        with self._lock:
            times = [entry.last_access_ns for entry in self._entries.values()]
            recovered_range = self._recovered.access_range_ns()
            if recovered_range is not None:
                times += recovered_range
            if not times:
                return None, None
            return min(times), max(times)

    def last_access_ns(self, key: PrefixKey) -> int | None:
        with self._lock:
            entry = self._entries.get(key)
            return self._recovered.last_access_ns(key) if entry is None else entry.last_access_ns

    # -- writes ----------------------------------------------------------------------------------------------

    def admit(self, pending: PendingWrite, *, raw_bytes: int, stored_bound_bytes: int, now_ns: int) -> Admission:
        """Make a chunk resident as a pending write.

        Blocks while writes in flight fill the capacity (backpressure: they become evictable once committed);
        rejects the chunk when pinned chunks alone leave no room for it.
        """
        key = pending.record.key
        with self._lock:
            while True:
                if key in self._entries or key in self._recovered:
                    return Admission.ALREADY_RESIDENT
                if self._pinned_stored_bytes + stored_bound_bytes > self.capacity_bytes:
                    self._counters.rejected_puts += 1
                    return Admission.NO_ROOM
                in_flight = self._pinned_stored_bytes + self._pending_bound_bytes
                if in_flight + stored_bound_bytes <= self.capacity_bytes or not self._pending_bound_bytes:
                    break
                self._pending_done.wait()
            self._entries[key] = IndexEntry(
                num_tokens=pending.record.num_tokens,
                raw_bytes=raw_bytes,
                stored_bytes=stored_bound_bytes,
                num_frames=0,
                frame_bytes=0,
                last_access_ns=now_ns,
                pending=pending,
            )
            self._pending_bound_bytes += stored_bound_bytes
            self._raw_bytes += raw_bytes
            self._residency.stored(TierName.DISK, pending.record)
            return Admission.ADMITTED

    def commit(self, key: PrefixKey, *, stored_bytes: int, num_frames: int, frame_bytes: int) -> None:
        """The writer committed a pending chunk: it now lives in LMDB."""
        with self._lock:
            entry = self._entries[key]
            assert entry.pending is not None, "DiskState.commit of a chunk that is not pending: writer bookkeeping"
            self._pending_bound_bytes -= entry.stored_bytes
            entry.stored_bytes, entry.num_frames, entry.frame_bytes = stored_bytes, num_frames, frame_bytes
            entry.pending = None
            self._stored_bytes += stored_bytes
            if entry.num_pins:
                self._pinned_stored_bytes += stored_bytes
            self._counters.puts += 1
            self._pending_done.notify_all()

    def abandon(self, key: PrefixKey, *, rejected: bool) -> None:
        """A pending write will not be committed (it failed, or no room was left at commit time)."""
        with self._lock:
            entry = self._entries.pop(key)
            assert entry.pending is not None, "DiskState.abandon of a committed chunk: writer bookkeeping"
            self._pending_bound_bytes -= entry.stored_bytes
            self._raw_bytes -= entry.raw_bytes
            if entry.num_pins:  # a pending chunk pinned by a lookup (its pinned bytes were never counted)
                self._num_pinned -= 1
            if rejected:
                self._counters.rejected_puts += 1
            else:
                self._counters.write_errors += 1
            self._residency.removed(TierName.DISK, (key,))
            self._pending_done.notify_all()

    def wait_for_readers(self, pending: PendingWrite) -> None:
        """Block until no reader is copying out of ``pending`` (its bytes may then be released)."""
        with self._readers_done:
            while pending.num_readers:
                self._readers_done.wait()

    def take_dirty_access(self) -> dict[PrefixKey, int]:
        """Last-access times of committed chunks changed since the last call (the writer persists them)."""
        with self._lock:
            dirty, self._dirty_access = self._dirty_access, {}
            return {key: ns for key, ns in dirty.items() if (e := self._entries.get(key)) and e.pending is None}

    # -- reads -----------------------------------------------------------------------------------------------

    def begin_read(self, key: PrefixKey, now_ns: int) -> ReadTicket | None:
        """Look a chunk up for reading and mark it used; ``None`` (a counted miss) when it is not resident.

        A pending hit counts a reader of its bytes: call ``end_pending_read`` when the copy is done.
        """
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._take_recovered_locked(key)
                if entry is None:
                    return None
            self._entries.move_to_end(key)
            entry.last_access_ns = now_ns
            if entry.pending is not None:
                entry.pending.num_readers += 1
            else:
                self._dirty_access[key] = now_ns
            return ReadTicket(
                raw_bytes=entry.raw_bytes,
                num_frames=entry.num_frames,
                frame_bytes=entry.frame_bytes,
                pending=entry.pending,
            )

    def end_pending_read(self, pending: PendingWrite) -> None:
        with self._lock:
            pending.num_readers -= 1
            if pending.num_readers == 0:
                self._readers_done.notify_all()

    def count_corrupt_read(self) -> None:
        with self._lock:
            self._counters.corrupt_reads += 1

    def count_write_error(self) -> None:
        with self._lock:
            self._counters.write_errors += 1

    # -- pins and removal ------------------------------------------------------------------------------------

    def pin(self, key: PrefixKey) -> bool:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                pinned = self._recovered.pin(key)
                if pinned is None:
                    return False
                num_pins, stored_bytes = pinned
                if num_pins == 1:
                    self._num_pinned += 1
                    self._pinned_stored_bytes += stored_bytes
                return True
            entry.num_pins += 1
            if entry.num_pins == 1:
                self._num_pinned += 1
                if entry.pending is None:
                    self._pinned_stored_bytes += entry.stored_bytes
            return True

    def unpin(self, key: PrefixKey) -> None:
        """Undo one ``pin``; a no-op when the chunk is gone (dropped as corrupt) or not pinned."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                unpinned = self._recovered.unpin(key)
                if unpinned is not None and unpinned[0] == 0:
                    self._num_pinned -= 1
                    self._pinned_stored_bytes -= unpinned[1]
                return
            if entry.num_pins == 0:
                return
            entry.num_pins -= 1
            if entry.num_pins == 0:
                self._num_pinned -= 1
                if entry.pending is None:
                    self._pinned_stored_bytes -= entry.stored_bytes

    def evict(self, key: PrefixKey) -> bool:
        """Remove an unpinned committed chunk (the caller deletes it from LMDB)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None and self._recovered.num_pins(key) == 0:
                entry = self._take_recovered_locked(key)  # removed just below
            if entry is None or entry.num_pins or entry.pending is not None:
                return False
            self._remove_locked(key, entry)
            self._counters.evictions += 1
            return True

    def drop(self, key: PrefixKey) -> bool:
        """Remove a committed chunk whatever its pins (it is corrupt); ``False`` when already gone."""
        with self._lock:
            entry = self._entries.get(key) or self._take_recovered_locked(key)
            if entry is None or entry.pending is not None:
                return False
            self._remove_locked(key, entry)
            return True

    def take_victims(self, num_bytes: int) -> tuple[list[PrefixKey], int]:
        """Remove least recently used unpinned committed chunks until ``num_bytes`` stored bytes are freed.

        Returns:
            The removed keys (the caller deletes them from LMDB) and the stored bytes they held.
        """
        recovered_victims: list[PrefixKey] = []
        victims: list[PrefixKey] = []
        freed = 0
        with self._lock:
            if num_bytes > 0:
                for key, stored_bytes in self._recovered.iter_unpinned():
                    recovered_victims.append(key)
                    freed += stored_bytes
                    if freed >= num_bytes:
                        break
            for key, entry in self._entries.items():
                if freed >= num_bytes:
                    break
                if entry.num_pins == 0 and entry.pending is None:
                    victims.append(key)
                    freed += entry.stored_bytes
            for key in recovered_victims:
                taken = self._take_recovered_locked(key)
                assert taken is not None, "DiskState.take_victims: a recovered victim vanished under the lock"
                self._remove_locked(key, taken)
            for key in victims:
                self._remove_locked(key, self._entries[key])
            self._counters.evictions += len(recovered_victims) + len(victims)
        return recovered_victims + victims, freed

    def overflow_bytes(self, incoming_bytes: int) -> int:
        """Stored bytes to free before ``incoming_bytes`` more fit under the capacity (0 when they fit)."""
        with self._lock:
            return max(0, self._stored_bytes + incoming_bytes - self.capacity_bytes)

    def _take_recovered_locked(self, key: PrefixKey) -> IndexEntry | None:
        """Move a recovered chunk into ``_entries`` (at the most recently used end; callers using it move it there
        anyway, callers removing it remove it next); ``None`` when it is not a recovered row."""
        row = self._recovered.take(key)
        if row is None:
            return None
        entry = IndexEntry(
            num_tokens=row.num_tokens,
            raw_bytes=row.raw_bytes,
            stored_bytes=row.stored_bytes,
            num_frames=row.num_frames,
            frame_bytes=row.frame_bytes,
            last_access_ns=row.last_access_ns,
            num_pins=row.num_pins,
        )
        self._entries[key] = entry
        return entry

    def _remove_locked(self, key: PrefixKey, entry: IndexEntry) -> None:
        del self._entries[key]
        self._residency.removed(TierName.DISK, (key,))
        self._dirty_access.pop(key, None)
        self._stored_bytes -= entry.stored_bytes
        self._raw_bytes -= entry.raw_bytes
        if entry.num_pins:
            self._num_pinned -= 1
            self._pinned_stored_bytes -= entry.stored_bytes

    # -- stats -----------------------------------------------------------------------------------------------

    def stats(self) -> TierStats:
        with self._lock:
            counters = self._counters
            return TierStats(
                tier=TierName.DISK,
                capacity_bytes=self.capacity_bytes,
                used_bytes=self._raw_bytes,
                stored_bytes=self._stored_bytes,
                num_chunks=len(self._entries) + len(self._recovered),
                num_pinned=self._num_pinned,
                puts=counters.puts,
                rejected_puts=counters.rejected_puts,
                evictions=counters.evictions,
                corrupt_reads=counters.corrupt_reads,
            )

    def counters(self) -> DiskCounters:
        """A copy of the counters (``write_errors`` is not part of ``TierStats``)."""
        with self._lock:
            c = self._counters
            return DiskCounters(c.puts, c.rejected_puts, c.evictions, c.corrupt_reads, c.write_errors)

    def num_pending(self) -> int:
        with self._lock:
            return sum(1 for entry in self._entries.values() if entry.pending is not None)
