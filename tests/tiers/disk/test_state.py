"""DiskState with recovered chunks kept as arrays behaves exactly like one OrderedDict of entries filled in
last-access order at open: same keys in the same LRU order, same victims, sizes, pins and counters, whatever
sequence of writes, reads, pins and evictions follows (hypothesis against a plain model)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvstore.keys import PrefixKey
from kvstore.tiers.base import ChunkRecord
from kvstore.tiers.disk.entries import Admission, PendingWrite
from kvstore.tiers.disk.recovered import RecoveredChunks
from kvstore.tiers.disk.state import DiskState

CAPACITY_BYTES = 2_000
NUM_KEYS = 6  # few keys: operations keep landing on the same chunks


def key_of(key_id: int) -> PrefixKey:
    return PrefixKey(key_id.to_bytes(16, "big"))


@dataclass
class ModelEntry:
    num_tokens: int
    raw_bytes: int
    stored_bytes: int
    last_access_ns: int
    num_pins: int = 0
    pending: bool = False


class Model:
    """The disk index's rules on one OrderedDict (how DiskState worked before recovered rows existed)."""

    def __init__(self, recovered: list[tuple[PrefixKey, ModelEntry]]) -> None:
        self.entries: OrderedDict[PrefixKey, ModelEntry] = OrderedDict(
            sorted(recovered, key=lambda item: item[1].last_access_ns)  # stable: ties in key order
        )
        self.dirty: dict[PrefixKey, int] = {}
        self.rejected = self.evictions = self.puts = self.write_errors = 0

    def stored_bytes(self) -> int:
        return sum(entry.stored_bytes for entry in self.entries.values() if not entry.pending)

    def pinned_stored_bytes(self) -> int:
        return sum(e.stored_bytes for e in self.entries.values() if e.num_pins and not e.pending)

    def pending_bound_bytes(self) -> int:
        return sum(entry.stored_bytes for entry in self.entries.values() if entry.pending)

    def would_block(self, key: PrefixKey, bound_bytes: int) -> bool:
        if key in self.entries or self.pinned_stored_bytes() + bound_bytes > CAPACITY_BYTES:
            return False
        in_flight = self.pinned_stored_bytes() + self.pending_bound_bytes()
        return in_flight + bound_bytes > CAPACITY_BYTES and self.pending_bound_bytes() > 0

    def admit(self, key: PrefixKey, bound_bytes: int, now_ns: int) -> Admission:
        if key in self.entries:
            return Admission.ALREADY_RESIDENT
        if self.pinned_stored_bytes() + bound_bytes > CAPACITY_BYTES:
            self.rejected += 1
            return Admission.NO_ROOM
        self.entries[key] = ModelEntry(num_tokens=4, raw_bytes=40, stored_bytes=bound_bytes, last_access_ns=now_ns,
                                       pending=True)  # fmt: skip
        return Admission.ADMITTED

    def read(self, key: PrefixKey, now_ns: int) -> bool:
        entry = self.entries.get(key)
        if entry is None:
            return False
        self.entries.move_to_end(key)
        entry.last_access_ns = now_ns
        if not entry.pending:
            self.dirty[key] = now_ns
        return True

    def take_victims(self, num_bytes: int) -> tuple[list[PrefixKey], int]:
        victims, freed = [], 0
        for key, entry in self.entries.items():
            if freed >= num_bytes:
                break
            if entry.num_pins == 0 and not entry.pending:
                victims.append(key)
                freed += entry.stored_bytes
        for key in victims:
            self.remove(key)
        self.evictions += len(victims)
        return victims, freed

    def remove(self, key: PrefixKey) -> None:
        del self.entries[key]
        self.dirty.pop(key, None)


OPERATIONS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "commit", "abandon", "read", "pin", "unpin", "evict", "drop", "victims", "dirty"]),
        st.integers(0, NUM_KEYS - 1),
        st.integers(1, 700),
    ),
    max_size=60,
)


@settings(max_examples=400, deadline=None)
@given(
    recovered=st.lists(st.tuples(st.integers(1, 300), st.integers(0, 5)), max_size=NUM_KEYS),
    operations=OPERATIONS,
)
@example(recovered=[(5, 0), (5, 1)], operations=[("pin", 0, 1), ("victims", 0, 1)])  # a pinned row is no victim
@example(recovered=[(5, 1), (5, 1), (5, 0)], operations=[("read", 2, 1), ("victims", 0, 6)])  # ties: key order
def test_recovered_rows_keep_the_lru_semantics_of_one_ordered_dict(
    recovered: list[tuple[int, int]], operations: list[tuple[str, int, int]]
) -> None:
    chunks = [
        (
            key_of(key_id),
            ModelEntry(num_tokens=key_id + 1, raw_bytes=10 * stored, stored_bytes=stored, last_access_ns=access),
        )
        for key_id, (stored, access) in enumerate(recovered)
    ]
    model = Model([(key, ModelEntry(**vars(entry))) for key, entry in chunks])
    index = DiskState(CAPACITY_BYTES)
    index.load(
        RecoveredChunks(
            keys=[key for key, _ in chunks],
            num_tokens=np.array([entry.num_tokens for _, entry in chunks], dtype=np.int64),
            raw_bytes=np.array([entry.raw_bytes for _, entry in chunks], dtype=np.int64),
            stored_bytes=np.array([entry.stored_bytes for _, entry in chunks], dtype=np.int64),
            num_frames=np.ones(len(chunks), dtype=np.int64),
            frame_bytes=np.full(len(chunks), 64, dtype=np.int64),
            last_access_ns=np.array([entry.last_access_ns for _, entry in chunks], dtype=np.uint64),
        )
    )
    pending: dict[PrefixKey, PendingWrite] = {}
    for step, (operation, key_id, amount) in enumerate(operations):
        key, now_ns = key_of(key_id), 1_000 + step
        model_entry = model.entries.get(key)
        if operation == "admit" and not model.would_block(key, amount):
            write = PendingWrite(record=ChunkRecord(key=key, source_start=0, tokens=np.arange(4, dtype=np.uint32)),
                                 data=np.zeros(40, dtype=np.uint8))  # fmt: skip
            outcome = index.admit(write, raw_bytes=40, stored_bound_bytes=amount, now_ns=now_ns)
            assert outcome is model.admit(key, amount, now_ns)
            if outcome is Admission.ADMITTED:
                pending[key] = write
        elif operation in ("commit", "abandon") and model_entry is not None and model_entry.pending:
            del pending[key]
            if operation == "commit":
                stored = min(amount, model_entry.stored_bytes)
                index.commit(key, stored_bytes=stored, num_frames=1, frame_bytes=64)
                model_entry.stored_bytes, model_entry.pending = stored, False
                model.puts += 1
            else:
                index.abandon(key, rejected=amount % 2 == 0)
                model.remove(key)
                model.rejected += amount % 2 == 0
                model.write_errors += amount % 2 == 1
        elif operation == "read":
            ticket = index.begin_read(key, now_ns)
            assert (ticket is not None) is model.read(key, now_ns)
            if ticket is not None and ticket.pending is not None:
                assert ticket.pending is pending[key]
                index.end_pending_read(ticket.pending)
        elif operation == "pin":
            assert index.pin(key) is (model_entry is not None)
            if model_entry is not None:
                model_entry.num_pins += 1
        elif operation == "unpin":
            index.unpin(key)
            if model_entry is not None and model_entry.num_pins:
                model_entry.num_pins -= 1
        elif operation == "evict":
            evictable = model_entry is not None and not model_entry.num_pins and not model_entry.pending
            assert index.evict(key) is evictable
            if evictable:
                model.remove(key)
                model.evictions += 1
        elif operation == "drop":
            droppable = model_entry is not None and not model_entry.pending
            assert index.drop(key) is droppable
            if droppable:
                model.remove(key)
        elif operation == "victims":
            assert index.take_victims(amount) == model.take_victims(amount)
        elif operation == "dirty":
            expected = {k: ns for k, ns in model.dirty.items() if k in model.entries and not model.entries[k].pending}
            model.dirty = {}
            assert index.take_dirty_access() == expected
        assert_same(index, model)


def assert_same(index: DiskState, model: Model) -> None:
    assert index.keys() == list(model.entries)
    stats = index.stats()
    assert stats.num_chunks == len(model.entries)
    assert stats.stored_bytes == model.stored_bytes()
    assert stats.used_bytes == sum(entry.raw_bytes for entry in model.entries.values())
    assert stats.num_pinned == sum(1 for entry in model.entries.values() if entry.num_pins)
    assert (stats.rejected_puts, stats.evictions, stats.puts) == (model.rejected, model.evictions, model.puts)
    assert index.counters().write_errors == model.write_errors
    assert index.overflow_bytes(0) == max(0, model.stored_bytes() - CAPACITY_BYTES)
    assert index.num_pending() == sum(1 for entry in model.entries.values() if entry.pending)
    times = [entry.last_access_ns for entry in model.entries.values()]
    assert index.access_range_ns() == ((min(times), max(times)) if times else (None, None))
    all_keys = [key_of(key_id) for key_id in range(NUM_KEYS)]
    assert index.resident_mask(all_keys).tolist() == [key in model.entries for key in all_keys]
    for key in all_keys:
        entry = model.entries.get(key)
        assert index.contains(key) is (entry is not None)
        assert index.num_tokens(key) == (None if entry is None else entry.num_tokens)
        assert index.last_access_ns(key) == (None if entry is None else entry.last_access_ns)


def test_load_refuses_a_used_index() -> None:
    index = DiskState(CAPACITY_BYTES)
    write = PendingWrite(record=ChunkRecord(key=key_of(1), source_start=0, tokens=np.arange(4, dtype=np.uint32)),
                         data=np.zeros(40, dtype=np.uint8))  # fmt: skip
    index.admit(write, raw_bytes=40, stored_bound_bytes=10, now_ns=1)
    with pytest.raises(AssertionError, match="load after use"):
        index.load(RecoveredChunks.concatenate([]))
