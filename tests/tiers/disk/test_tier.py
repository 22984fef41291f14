"""DiskTier on real LMDB under tmp_path: round trips, restarts, ownership, capacity, corruption, failures."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import lmdb
import pytest
import torch

from kvstore.errors import InvalidInputError, LayoutMismatchError, StorageError, StoreClosedError
from kvstore.keys import PrefixKey, as_token_array, prefix_keys
from kvstore.layout import KVDtype, KVLayout
from kvstore.tiers.base import ChunkRecord
from kvstore.tiers.disk.format import frame_key
from kvstore.tiers.disk.tier import DiskTier, DiskTuning
from tests.factories import make_kv, make_tokens

CHUNK = 16
FRAME_BYTES = 2048  # a small layout's 8 KiB chunk spans four frames
CAPACITY = 1 << 20
REPO_ROOT = Path(__file__).resolve().parents[3]


class OpenTier(Protocol):
    def __call__(self, **kwargs: object) -> DiskTier: ...


SizedTier = Callable[..., tuple[DiskTier, torch.Tensor]]


class FakeClock:
    """Strictly increasing nanoseconds, so last-access order is deterministic."""

    def __init__(self) -> None:
        self.now_ns = 1_700_000_000_000_000_000

    def __call__(self) -> int:
        self.now_ns += 1_000
        return self.now_ns


def chunk_records(layout: KVLayout, num_tokens: int, seed: int = 0) -> list[ChunkRecord]:
    tokens = as_token_array(make_tokens(num_tokens, seed))
    return [
        ChunkRecord(key=key, source_start=idx * CHUNK, tokens=tokens[idx * CHUNK : (idx + 1) * CHUNK])
        for idx, key in enumerate(prefix_keys(layout.namespace, tokens, CHUNK))
    ]


def chunk_kvs(layout: KVLayout, records: list[ChunkRecord], seed: int = 0) -> list[torch.Tensor]:
    return [make_kv(layout, record.num_tokens, seed + idx) for idx, record in enumerate(records)]


def bits(kv: torch.Tensor) -> torch.Tensor:
    """Compare raw bits, so NaNs and -0.0 count too."""
    return kv.contiguous().view(torch.uint8)


def put_chunks(
    tier: DiskTier, layout: KVLayout, num_tokens: int, seed: int = 0, kv_seed: int = 0
) -> tuple[list[ChunkRecord], list[torch.Tensor]]:
    """Put the chunks of a random ``num_tokens``-token sequence; returns their records and KV."""
    records = chunk_records(layout, num_tokens, seed)
    kvs = chunk_kvs(layout, records, kv_seed)
    for record, kv in zip(records, kvs, strict=True):
        tier.put(record, kv)
    return records, kvs


def read(tier: DiskTier, key: PrefixKey, like: torch.Tensor) -> torch.Tensor | None:
    out = torch.full_like(like, 7.0)
    return out if tier.get_into(key, out) else None


@pytest.fixture
def open_tier(tmp_path: Path, small_layout: KVLayout) -> Iterator[OpenTier]:
    """Open DiskTiers on ``tmp_path/data`` (same layout unless told) and close them all afterwards."""
    opened: list[DiskTier] = []

    def build(**kwargs: object) -> DiskTier:
        args: dict[str, object] = {
            "path": tmp_path / "data",
            "layout": small_layout,
            "chunk_size": CHUNK,
            "capacity_bytes": CAPACITY,
            "frame_bytes": FRAME_BYTES,
        }
        args.update(kwargs)
        tier = DiskTier(**args)  # type: ignore[arg-type]
        opened.append(tier)
        return tier

    yield build
    for tier in opened:
        tier.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_round_trip_including_a_partial_chunk_before_and_after_commit(
    open_tier: OpenTier, small_layout: KVLayout, dtype: str
) -> None:
    layout = dataclasses.replace(small_layout, dtype=KVDtype(dtype))
    tier = open_tier(layout=layout)
    records = chunk_records(layout, 2 * CHUNK + 5)
    kvs = chunk_kvs(layout, records)
    kvs[0][0, 0, 0, 0, :2] = torch.tensor([float("nan"), -0.0])
    for record, kv in zip(records, kvs, strict=True):
        strided = kv.transpose(3, 4).contiguous().transpose(3, 4)  # the same values, non-contiguous
        assert not strided.is_contiguous() and tier.put(record, strided)  # any strides are fine for put
    assert tier.num_tokens(records[2].key) == 5
    for record, kv in zip(records, kvs, strict=True):  # read-your-writes, committed or not
        out = read(tier, record.key, kv)
        assert out is not None and torch.equal(bits(out), bits(kv))
    tier.flush()
    for record, kv in zip(records, kvs, strict=True):
        out = read(tier, record.key, kv)
        assert out is not None and torch.equal(bits(out), bits(kv))
    stats = tier.stats()
    assert stats.num_chunks == 3 and stats.puts == 3 and stats.hits == 0, "reads are not hits (TierStats)"
    assert stats.used_bytes == layout.chunk_bytes(2 * CHUNK + 5)
    assert 0 < stats.stored_bytes <= CAPACITY
    assert tier.put(records[0], kvs[0]) and tier.stats().puts == 3  # already there: a no-op
    assert not tier.get_into(chunk_records(layout, CHUNK, seed=99)[0].key, torch.empty_like(kvs[0]))


def test_reopen_serves_everything_with_metadata_tokens_and_lru_order(
    open_tier: OpenTier, small_layout: KVLayout
) -> None:
    clock = FakeClock()
    tier = open_tier(clock=clock)
    records, kvs = put_chunks(tier, small_layout, 4 * CHUNK + 3, seed=1, kv_seed=10)
    tier.flush()
    assert read(tier, records[1].key, kvs[1]) is not None  # touched: now the most recent
    order = tier.keys()
    assert order == [r.key for r in records[:1] + records[2:] + records[1:2]]
    touched_ns = clock.now_ns
    tier.close()

    reopened = open_tier(clock=clock)
    assert reopened.keys() == order
    for record, kv in zip(records, kvs, strict=True):
        out = read(reopened, record.key, kv)
        assert out is not None and torch.equal(bits(out), bits(kv))
        assert _same_record(reopened.record(record.key), record)
    stored = {chunk.key: chunk for chunk in reopened.iter_records(batch_size=2)}
    assert set(stored) == {r.key for r in records}
    for record in records:
        chunk = stored[record.key]
        assert (chunk.num_tokens, chunk.source_start) == (record.num_tokens, record.source_start)
        assert chunk.tokens.tolist() == record.tokens.tolist()
        assert chunk.raw_bytes == small_layout.chunk_bytes(record.num_tokens)
        assert chunk.num_frames == -(-chunk.raw_bytes // FRAME_BYTES)
    assert stored[records[1].key].last_access_ns >= touched_ns
    info = reopened.describe()
    assert info.num_chunks == 5 and info.layout == small_layout and info.chunk_size == CHUNK
    assert info.oldest_access_ns is not None and info.newest_access_ns is not None
    assert info.oldest_access_ns < info.newest_access_ns


def _same_record(got: ChunkRecord | None, want: ChunkRecord) -> bool:
    return (
        got is not None
        and got.key == want.key
        and got.source_start == want.source_start
        and got.tokens.tolist() == want.tokens.tolist()
    )


def test_last_access_times_persist_lazily(open_tier: OpenTier, small_layout: KVLayout) -> None:
    clock = FakeClock()
    tier = open_tier(clock=clock)
    records, kvs = put_chunks(tier, small_layout, 3 * CHUNK, seed=2)
    tier.flush()
    read(tier, records[0].key, kvs[0])
    hit_ns = clock.now_ns
    tier.close()  # persists the hit
    reopened = open_tier(clock=clock, read_only=True)
    assert {c.key: c.last_access_ns for c in reopened.iter_records()}[records[0].key] == hit_ns
    assert reopened.keys()[-1] == records[0].key


def test_open_existing_reads_the_recorded_layout(open_tier: OpenTier, tmp_path: Path, small_layout: KVLayout) -> None:
    tier = open_tier()
    record, kv = chunk_records(small_layout, CHUNK)[0], make_kv(small_layout, CHUNK)
    tier.put(record, kv)
    tier.close()
    existing = DiskTier.open_existing(tmp_path / "data")
    try:
        assert existing.read_only and existing.layout == small_layout and existing.chunk_size == CHUNK
        assert existing.capacity_bytes == CAPACITY
        out = read(existing, record.key, kv)
        assert out is not None and torch.equal(out, kv)
    finally:
        existing.close()
    with pytest.raises(StorageError, match=r"no data\.mdb"):
        DiskTier.open_existing(tmp_path / "nowhere")


def test_another_layout_or_chunk_size_is_refused(open_tier: OpenTier, small_layout: KVLayout) -> None:
    open_tier().close()
    with pytest.raises(LayoutMismatchError, match=r"x 16, bfloat16.*x 32, bfloat16"):
        open_tier(layout=dataclasses.replace(small_layout, head_dim=32))
    with pytest.raises(LayoutMismatchError, match=r"chunk_size=16.*chunk_size=32"):
        open_tier(chunk_size=32)
    with pytest.raises(LayoutMismatchError, match="other/model"):
        open_tier(layout=dataclasses.replace(small_layout, model_id="other/model"))
    open_tier()  # the right layout still opens


def test_a_second_writer_in_this_process_is_refused(open_tier: OpenTier) -> None:
    open_tier()
    with pytest.raises(StorageError, match=f"held by this process \\(pid {os.getpid()}\\)"):
        open_tier()


def test_other_process_is_refused_as_writer_but_reads_read_only(
    open_tier: OpenTier, tmp_path: Path, small_layout: KVLayout
) -> None:
    tier = open_tier()
    records, kvs = put_chunks(tier, small_layout, 2 * CHUNK, seed=3)
    tier.flush()
    script = textwrap.dedent(
        f"""
        import json, sys
        from pathlib import Path
        import torch
        from kvstore.errors import StorageError
        from kvstore.layout import KVDtype, KVLayout
        from kvstore.tiers.disk.tier import DiskTier
        path, layout = Path({str(tmp_path / "data")!r}), KVLayout.from_json({small_layout.to_json()!r})
        report = {{}}
        try:
            DiskTier(path, layout, {CHUNK}, {CAPACITY}, frame_bytes={FRAME_BYTES})
        except StorageError as exc:
            report["writer"] = str(exc)
        reader = DiskTier(path, layout, {CHUNK}, {CAPACITY}, read_only=True)
        out = torch.empty({list(kvs[0].shape)}, dtype=torch.bfloat16)
        report["keys"] = [key.hex() for key in reader.keys()]
        report["read"] = reader.get_into(bytes.fromhex({records[0].key.hex()!r}), out)
        report["sum"] = float(out.float().sum())
        try:
            reader.put(reader.record(bytes.fromhex({records[0].key.hex()!r})), out)
        except StorageError as exc:
            report["put"] = str(exc)
        reader.close()
        print(json.dumps(report))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert f"held by process {os.getpid()}" in report["writer"]
    assert set(report["keys"]) == {r.key.hex() for r in records}
    assert report["read"] and report["sum"] == pytest.approx(float(kvs[0].float().sum()))
    assert "read-only" in report["put"]


def test_flush_makes_writes_durable_without_close(tmp_path: Path, small_layout: KVLayout) -> None:
    """A process that flushes and then dies without closing leaves every flushed chunk behind."""
    script = textwrap.dedent(
        f"""
        import os
        from pathlib import Path
        from kvstore.keys import as_token_array, prefix_keys
        from kvstore.layout import KVDtype, KVLayout
        from kvstore.tiers.base import ChunkRecord
        from kvstore.tiers.disk.tier import DiskTier
        from tests.factories import make_kv, make_tokens
        layout = KVLayout.from_json({small_layout.to_json()!r})
        path = Path({str(tmp_path / "data")!r})
        tier = DiskTier(path, layout, {CHUNK}, {CAPACITY}, frame_bytes={FRAME_BYTES})
        tokens = as_token_array(make_tokens({3 * CHUNK}, 4))
        for idx, key in enumerate(prefix_keys(layout.namespace, tokens, {CHUNK})):
            part = tokens[idx * {CHUNK} : (idx + 1) * {CHUNK}]
            record = ChunkRecord(key=key, source_start=idx * {CHUNK}, tokens=part)
            tier.put(record, make_kv(layout, len(part), idx))
        tier.flush()
        os._exit(0)  # no close(), no atexit: only what flush() committed survives
        """
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    tier = DiskTier(tmp_path / "data", small_layout, CHUNK, CAPACITY)  # the dead writer's lock is gone
    try:
        records = chunk_records(small_layout, 3 * CHUNK, seed=4)
        assert sorted(tier.keys()) == sorted(r.key for r in records)
        for idx, record in enumerate(records):
            out = read(tier, record.key, make_kv(small_layout, CHUNK, idx))
            assert out is not None and torch.equal(out, make_kv(small_layout, CHUNK, idx))
    finally:
        tier.close()


def lmdb_records(path: Path) -> dict[str, dict[bytes, int]]:
    """Every record of a closed data dir: sub-database name -> {key: value length}."""
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=4)
    try:
        with env.begin() as txn:
            return {
                name: {bytes(key): len(value) for key, value in txn.cursor(db=env.open_db(name.encode(), txn=txn))}
                for name in ("payload", "meta", "intent")
            }
    finally:
        env.close()


def test_frames_of_a_chunk_cut_short_by_a_crash_are_removed_at_open(
    open_tier: OpenTier, tmp_path: Path, small_layout: KVLayout
) -> None:
    tier = open_tier()
    records = chunk_records(small_layout, 2 * CHUNK, seed=12)
    kvs = chunk_kvs(small_layout, records)
    assert tier.put(records[0], kvs[0])
    tier.close()
    # A crash after the first two of four frame transactions of records[1] (intent + frames, no meta).
    env = lmdb.open(str(tmp_path / "data"), max_dbs=4)
    with env.begin(write=True) as txn:
        txn.put(records[1].key, (4).to_bytes(4, "little"), db=env.open_db(b"intent", txn=txn))
        for frame_idx in range(2):
            txn.put(frame_key(records[1].key, frame_idx), b"KVF\x01" + bytes(600), db=env.open_db(b"payload", txn=txn))
    env.close()

    tier = open_tier()
    assert tier.keys() == [records[0].key] and not tier.contains(records[1].key)
    out = read(tier, records[0].key, kvs[0])
    assert out is not None and torch.equal(out, kvs[0])
    stored_bytes = tier.stats().stored_bytes
    tier.close()
    contents = lmdb_records(tmp_path / "data")
    assert contents["intent"] == {} and list(contents["meta"]) == [records[0].key]
    assert all(key.startswith(records[0].key) for key in contents["payload"])
    assert sum(contents["payload"].values()) + sum(contents["meta"].values()) == stored_bytes
    tier = open_tier()
    assert tier.put(records[1], kvs[1])  # the key can be written again
    tier.flush()
    out = read(tier, records[1].key, kvs[1])
    assert out is not None and torch.equal(out, kvs[1])


@pytest.mark.parametrize("max_transaction_bytes", [1, 3 * FRAME_BYTES, 64 << 20])
def test_chunks_spread_over_many_transactions_round_trip_and_leave_no_intent(
    open_tier: OpenTier, tmp_path: Path, small_layout: KVLayout, max_transaction_bytes: int
) -> None:
    tuning = DiskTuning(max_transaction_bytes=max_transaction_bytes, tune_malloc=False)
    tier = open_tier(tuning=tuning)
    records = chunk_records(small_layout, 5 * CHUNK + 3, seed=13)  # four frames per full chunk, one partial chunk
    kvs = chunk_kvs(small_layout, records)
    for record, kv in zip(records, kvs, strict=True):
        assert tier.put(record, kv)
    tier.close()
    contents = lmdb_records(tmp_path / "data")
    assert contents["intent"] == {} and len(contents["meta"]) == len(records)
    tier = open_tier(tuning=tuning)
    for record, kv in zip(records, kvs, strict=True):
        out = read(tier, record.key, kv)
        assert out is not None and torch.equal(out, kv)
    assert sum(contents["payload"].values()) + sum(contents["meta"].values()) == tier.stats().stored_bytes


def fill(tier: DiskTier, records: list[ChunkRecord], kv: torch.Tensor) -> None:
    for record in records:
        assert tier.put(record, kv)
    tier.flush()


@pytest.fixture
def sized(open_tier: OpenTier, small_layout: KVLayout, tmp_path: Path) -> SizedTier:
    """A tier whose capacity holds exactly ``num_chunks`` chunks of one same KV (so LRU order is exact)."""

    def build(num_chunks: int, **kwargs: object) -> tuple[DiskTier, torch.Tensor]:
        kv = make_kv(small_layout, CHUNK, 42)
        probe = open_tier(path=tmp_path / "probe")
        fill(probe, chunk_records(small_layout, CHUNK, seed=500), kv)
        unit = probe.stats().stored_bytes
        probe.close()
        return open_tier(capacity_bytes=num_chunks * unit + unit // 2, **kwargs), kv

    return build


def test_lru_eviction_keeps_the_recently_used(sized: SizedTier, small_layout: KVLayout) -> None:
    tier, kv = sized(5)
    records = chunk_records(small_layout, 7 * CHUNK, seed=5)
    fill(tier, records[:5], kv)
    assert read(tier, records[0].key, kv) is not None  # touch the oldest
    fill(tier, records[5:], kv)
    survivors = [records[i].key for i in (3, 4, 0, 5, 6)]
    assert tier.keys() == survivors
    assert tier.stats().evictions == 2 and tier.stats().stored_bytes <= tier.capacity_bytes
    assert not tier.contains(records[1].key) and read(tier, records[1].key, kv) is None


def test_ten_times_the_cap_stays_under_it(sized: SizedTier, small_layout: KVLayout) -> None:
    tier, kv = sized(6)
    records = chunk_records(small_layout, 61 * CHUNK, seed=6)
    hot = records[0]
    fill(tier, [hot], kv)
    for start in range(1, len(records), 5):  # 60 more chunks: ten times what the cap holds
        fill(tier, records[start : start + 5], kv)
        assert tier.get_into(hot.key, torch.empty_like(kv))  # touched every round: never the LRU victim
        stats = tier.stats()
        assert stats.stored_bytes <= tier.capacity_bytes
    info = tier.describe()
    assert tier.contains(hot.key) and info.num_chunks == 6
    assert info.file_bytes <= info.map_size_bytes
    assert info.map_size_bytes <= DiskTuning().map_limit_bytes(tier.capacity_bytes)
    assert info.file_bytes <= 2 * tier.capacity_bytes + (8 << 20), "data.mdb kept growing past the cap"


def test_pinned_chunks_survive_eviction_and_a_full_pinned_tier_rejects(
    sized: SizedTier, small_layout: KVLayout
) -> None:
    tier, kv = sized(4)
    records = chunk_records(small_layout, 12 * CHUNK, seed=7)
    fill(tier, records[:4], kv)
    assert tier.pin(records[0].key) and tier.pin(records[1].key) and tier.pin(records[1].key)
    fill(tier, records[4:8], kv)
    assert tier.contains(records[0].key) and tier.contains(records[1].key)
    assert tier.stats().num_pinned == 2
    assert not tier.evict(records[0].key)
    assert tier.pin(records[6].key) and tier.pin(records[7].key)
    assert not tier.put(records[8], kv), "every byte is pinned: the put must be refused, not block"
    assert tier.stats().rejected_puts == 1
    tier.unpin(records[0].key)
    assert tier.evict(records[0].key) and not tier.contains(records[0].key)
    tier.unpin(records[1].key)
    tier.unpin(records[1].key)
    tier.unpin(records[1].key)  # one too many: ignored
    assert tier.evict_bytes(1) > 0 and not tier.contains(records[1].key)
    assert tier.put(records[8], kv)
    tier.flush()
    assert tier.contains(records[8].key)


def find_all(haystack: bytes, needle: bytes) -> list[int]:
    found, start = [], 0
    while (position := haystack.find(needle, start)) >= 0:
        found.append(position)
        start = position + 1
    return found


def test_flipped_byte_in_data_mdb_is_a_counted_miss(
    open_tier: OpenTier, tmp_path: Path, small_layout: KVLayout, caplog: pytest.LogCaptureFixture
) -> None:
    tier = open_tier()
    records, kvs = put_chunks(tier, small_layout, 4 * CHUNK, seed=8)
    tier.close()
    env = lmdb.open(str(tmp_path / "data"), readonly=True, lock=False, max_dbs=4)
    with env.begin() as txn:
        frame = txn.get(frame_key(records[1].key, 2), db=env.open_db(b"payload", txn=txn))
    env.close()
    assert frame is not None and frame[:4] == b"KVF\x01"
    data_file = tmp_path / "data" / "data.mdb"
    raw = bytearray(data_file.read_bytes())
    copies = find_all(bytes(raw), frame)  # the live value and stale copies in freed pages
    assert copies
    for position in copies:
        raw[position + len(frame) // 2] ^= 0x10
    data_file.write_bytes(bytes(raw))

    tier = open_tier()
    with caplog.at_level(logging.WARNING, logger="kvstore.tiers.disk.tier"):
        results = [read(tier, record.key, kv) for record, kv in zip(records, kvs, strict=True)]
    failed = [idx for idx, out in enumerate(results) if out is None]
    assert failed == [1]
    for idx, out in enumerate(results):
        if out is not None:
            assert torch.equal(out, kvs[idx])
    assert tier.stats().corrupt_reads == 1 and "failed to decode" in caplog.text
    assert not tier.contains(records[failed[0]].key)
    assert tier.put(records[failed[0]], kvs[failed[0]])  # the store keeps working: it can be written again
    out = read(tier, records[failed[0]].key, kvs[failed[0]])
    assert out is not None and torch.equal(out, kvs[failed[0]])


def test_flipped_byte_in_a_meta_record_drops_only_that_chunk(
    open_tier: OpenTier, tmp_path: Path, small_layout: KVLayout
) -> None:
    tier = open_tier()
    records, _ = put_chunks(tier, small_layout, 3 * CHUNK, seed=9)
    tier.close()
    data_file = tmp_path / "data" / "data.mdb"
    raw = bytearray(data_file.read_bytes())
    copies = find_all(bytes(raw), records[1].tokens.tobytes())  # the live record, maybe stale copies
    assert copies
    for position in copies:
        raw[position + 3] ^= 0x01
    data_file.write_bytes(bytes(raw))
    tier = open_tier()
    assert sorted(tier.keys()) == sorted([records[0].key, records[2].key])
    tier.close()
    assert sorted(open_tier(read_only=True).keys()) == sorted([records[0].key, records[2].key])  # deleted at open


def test_put_borrowed_calls_on_done_exactly_once(open_tier: OpenTier, small_layout: KVLayout) -> None:
    tier = open_tier()
    records = chunk_records(small_layout, 3 * CHUNK, seed=10)
    kvs = chunk_kvs(small_layout, records)
    calls: dict[str, int] = {}

    def done(name: str) -> Callable[[], None]:
        return lambda: calls.__setitem__(name, calls.get(name, 0) + 1)

    assert tier.put_borrowed(records[0], kvs[0], done("written"))
    out = read(tier, records[0].key, kvs[0])  # served from the borrowed tensor or from LMDB
    assert out is not None and torch.equal(out, kvs[0])
    tier.flush()
    assert calls == {"written": 1}
    assert tier.put_borrowed(records[0], kvs[0], done("again"))
    assert calls["again"] == 1  # already resident: released at once
    with pytest.raises(InvalidInputError):
        tier.put_borrowed(records[1], kvs[0][:, :, :3], done("bad shape"))
    with pytest.raises(InvalidInputError, match="contiguous cpu"):
        tier.put_borrowed(records[1], kvs[1].transpose(3, 4).contiguous().transpose(3, 4), done("strided"))
    assert tier.put_borrowed(records[2], kvs[2], done("closing"))
    tier.close()  # drains the queue: the write commits and releases the tensor
    with pytest.raises(StoreClosedError):
        tier.put_borrowed(records[1], kvs[1], done("closed"))
    assert calls == {"written": 1, "again": 1, "bad shape": 1, "strided": 1, "closing": 1, "closed": 1}


def test_a_failing_write_is_counted_not_raised_and_the_writer_survives(
    open_tier: OpenTier, small_layout: KVLayout, caplog: pytest.LogCaptureFixture
) -> None:
    # A map too small for a full chunk, not allowed to grow: the commit fails with MapFullError in the writer.
    tight = DiskTuning(map_size_bytes=128 << 10, max_map_bytes=128 << 10, tune_malloc=False)
    big_layout = dataclasses.replace(small_layout, num_layers=128)  # 256 KiB per full chunk, 32 KiB for 2 tokens
    tier = open_tier(layout=big_layout, tuning=tight)
    records = chunk_records(big_layout, CHUNK + 2, seed=11)
    kvs = chunk_kvs(big_layout, records)
    released: list[str] = []
    with caplog.at_level(logging.ERROR, logger="kvstore.tiers.disk.writer"):
        assert tier.put_borrowed(records[0], kvs[0], lambda: released.append("full"))
        tier.flush()
    assert released == ["full"] and not tier.contains(records[0].key)
    assert tier.describe().write_errors == 1 and "writes are dropped" in caplog.text
    assert tier.put(records[1], kvs[1])  # a 2-token chunk fits: the writer thread is still alive
    tier.flush()
    out = read(tier, records[1].key, kvs[1])
    assert out is not None and torch.equal(out, kvs[1])
    assert tier.stats().puts == 1


def test_use_after_close_raises(open_tier: OpenTier, small_layout: KVLayout) -> None:
    tier = open_tier()
    record, kv = chunk_records(small_layout, CHUNK)[0], make_kv(small_layout, CHUNK)
    tier.put(record, kv)
    tier.close()
    tier.close()  # idempotent
    for call in (
        lambda: tier.contains(record.key),
        lambda: tier.put(record, kv),
        lambda: tier.get_into(record.key, torch.empty_like(kv)),
        lambda: tier.pin(record.key),
        lambda: tier.evict(record.key),
        lambda: tier.flush(),
        lambda: tier.keys(),
        lambda: list(tier.iter_records()),
    ):
        with pytest.raises(StoreClosedError):
            call()
    assert tier.stats().puts == 1  # counters stay readable


def test_read_only_tier_refuses_writes(open_tier: OpenTier, small_layout: KVLayout) -> None:
    record, kv = chunk_records(small_layout, CHUNK)[0], make_kv(small_layout, CHUNK)
    writer = open_tier()
    writer.put(record, kv)
    writer.close()
    reader = open_tier(read_only=True)
    with pytest.raises(StorageError, match="read-only"):
        reader.put(record, kv)
    with pytest.raises(StorageError, match="read-only"):
        reader.evict(record.key)
    reader.flush()  # nothing to flush
    out = read(reader, record.key, kv)
    assert out is not None and torch.equal(out, kv)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_use_in_a_forked_child_raises(open_tier: OpenTier, small_layout: KVLayout) -> None:
    tier = open_tier()
    record = chunk_records(small_layout, CHUNK)[0]
    pid = os.fork()
    if pid == 0:  # the child: must refuse, and must not touch the parent's environment
        try:
            tier.contains(record.key)
        except StorageError:
            os._exit(0)
        os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not tier.contains(record.key)  # the parent is unaffected


def test_bad_arguments_are_config_errors(open_tier: OpenTier, small_layout: KVLayout) -> None:
    from kvstore.errors import ConfigError

    with pytest.raises(ConfigError, match="below one chunk"):
        open_tier(capacity_bytes=1000)
    with pytest.raises(ConfigError, match="frame_bytes"):
        open_tier(frame_bytes=3)
    tier = open_tier()
    record = chunk_records(small_layout, CHUNK)[0]
    with pytest.raises(InvalidInputError):
        tier.put(record, make_kv(small_layout, CHUNK - 1))
    tier.put(record, make_kv(small_layout, CHUNK))
    with pytest.raises(InvalidInputError, match="holds"):
        tier.get_into(record.key, torch.empty(3))


def test_threads_put_and_read_at_once_under_eviction(sized: SizedTier, small_layout: KVLayout) -> None:
    tier, kv = sized(6)
    errors: list[str] = []

    def work(thread_idx: int) -> None:
        for record in chunk_records(small_layout, 12 * CHUNK, seed=100 + thread_idx):
            if not tier.put(record, kv):
                errors.append(f"put of {record.key.hex()} refused")
            out = torch.empty_like(kv)
            if tier.get_into(record.key, out) and not torch.equal(out, kv):  # may be evicted already: a miss
                errors.append(f"wrong bytes for {record.key.hex()}")

    threads = [threading.Thread(target=work, args=(idx,)) for idx in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    tier.flush()
    assert errors == []
    stats = tier.stats()
    assert stats.puts == 48 and stats.num_chunks <= 6 and stats.stored_bytes <= tier.capacity_bytes
    assert stats.evictions == stats.puts - stats.num_chunks


def test_a_writable_tier_preallocates_its_staging_unless_told_not_to(open_tier: OpenTier, tmp_path: Path) -> None:
    writable = open_tier()
    assert writable._staging.num_allocated == writable._staging.max_buffers  # puts never meet a fresh page
    writable.close()
    assert open_tier(read_only=True)._staging.num_allocated == 0  # no puts, no staging memory
    lazy = open_tier(path=tmp_path / "lazy", tuning=DiskTuning(preallocate_staging=False))
    assert lazy._staging.num_allocated == 0
