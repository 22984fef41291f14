"""Crashes, corruption, caps and bad input, with real processes and real LMDB files."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest
import torch

from kvstore import KVLayout, LayoutMismatchError, StoreConfig, TieredStore
from kvstore.errors import StorageError
from kvstore.store.inspection import check_data_dir
from kvstore.tiers.base import TierName
from kvstore.tiers.disk.format import frame_key
from tests.factories import make_kv, make_tokens
from tests.integration.storm_writer import LAYOUT, TOKENS_PER_SEQUENCE, config, sequence, storm_and_kill

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_kill_9_during_a_write_storm_loses_nothing_acknowledged_and_corrupts_nothing(tmp_path: Path) -> None:
    data = tmp_path / "data"
    durable = storm_and_kill(data, 48, timeout_s=60)  # mid-storm: it never stops writing
    assert durable >= 48, "the writer did not get going"

    with TieredStore(LAYOUT, config(data)) as store:
        seed, num_present = 0, 0
        while seed < durable + 64:
            tokens, kv = sequence(seed)
            result = store.retrieve(store.lookup(tokens))
            assert torch.equal(result.kv, kv[:, :, : result.num_prefix_tokens]), f"sequence {seed} read back different"
            if seed < durable:
                assert result.num_prefix_tokens == TOKENS_PER_SEQUENCE, f"acknowledged sequence {seed} lost"
            num_present += result.num_prefix_tokens > 0
            seed += 1
        disk = store.stats().tier(TierName.DISK)
        assert disk is not None and disk.corrupt_reads == 0
        assert num_present >= durable
    report = check_data_dir(data)
    assert report.ok and report.num_unfinished_frames == 0, report.problems


def _flip_byte_inside_frame(data_file: Path, frame_value: bytes, offset_in_value: int) -> None:
    raw = bytearray(data_file.read_bytes())
    position = raw.find(frame_value)
    assert position >= 0, "frame value not found contiguously in data.mdb"
    raw[position + offset_in_value] ^= 0x40
    data_file.write_bytes(bytes(raw))


def test_flipped_bytes_are_a_counted_miss_and_the_store_keeps_working(tmp_path: Path, small_layout: KVLayout) -> None:
    cfg = StoreConfig(tiers=(TierName.DISK,), chunk_size=256, data_dir=tmp_path / "data", disk_capacity_bytes=64 << 20)
    first_tokens, first_kv = make_tokens(512, 1), make_kv(small_layout, 512, 1)
    other_tokens, other_kv = make_tokens(256, 2), make_kv(small_layout, 256, 2)
    with TieredStore(small_layout, cfg) as store:
        store.store(first_tokens, first_kv)
        store.store(other_tokens, other_kv)
        second_chunk_key = store.lookup(first_tokens).segments[1].key
    env = lmdb.open(str(tmp_path / "data"), max_dbs=8, readonly=True, lock=False)
    with env.begin() as txn:
        frame = txn.get(frame_key(second_chunk_key, 0), db=env.open_db(b"payload", txn=txn))
    env.close()
    assert frame is not None
    _flip_byte_inside_frame(tmp_path / "data" / "data.mdb", bytes(frame), len(frame) // 2)

    with TieredStore(small_layout, cfg) as store:
        result = store.retrieve(store.lookup(first_tokens))
        assert result.num_prefix_tokens == 256, "the prefix is cut at the corrupt chunk, never served wrong"
        assert torch.equal(result.kv, first_kv[:, :, :256])
        assert store.stats().tier(TierName.DISK).corrupt_reads == 1  # type: ignore[union-attr]
        assert torch.equal(store.retrieve(store.lookup(other_tokens)).kv, other_kv)
        store.store(first_tokens, first_kv)  # the dropped chunk can be stored again
        assert torch.equal(store.retrieve(store.lookup(first_tokens)).kv, first_kv)


def test_writing_ten_times_the_cap_stays_under_it(tmp_path: Path, small_layout: KVLayout) -> None:
    cap = 16 << 20
    cfg = StoreConfig(
        tiers=(TierName.CPU, TierName.DISK),
        chunk_size=256,
        cpu_capacity_bytes=8 << 20,
        data_dir=tmp_path / "data",
        disk_capacity_bytes=cap,
    )
    chunk_bytes = small_layout.chunk_bytes(256)
    with TieredStore(small_layout, cfg) as store:
        for seed in range(10 * cap // chunk_bytes):
            store.store(make_tokens(256, seed), make_kv(small_layout, 256, seed))
        store.flush()
        disk = store.stats().tier(TierName.DISK)
        assert disk is not None and 0 < disk.stored_bytes <= cap
        newest = 10 * cap // chunk_bytes - 1
        assert torch.equal(
            store.retrieve(store.lookup(make_tokens(256, newest))).kv, make_kv(small_layout, 256, newest)
        )
    assert check_data_dir(tmp_path / "data").ok
    file_bytes = (tmp_path / "data" / "data.mdb").stat().st_size
    assert file_bytes <= 2 * cap + (64 << 20), f"data.mdb grew to {file_bytes} bytes for a {cap}-byte cap"


def test_another_layout_or_chunk_size_on_the_same_data_dir_is_refused(tmp_path: Path, small_layout: KVLayout) -> None:
    cfg = StoreConfig(tiers=(TierName.DISK,), chunk_size=256, data_dir=tmp_path / "data", disk_capacity_bytes=64 << 20)
    with TieredStore(small_layout, cfg) as store:
        store.store(make_tokens(256), make_kv(small_layout, 256))
    with pytest.raises(LayoutMismatchError, match="layout"):
        TieredStore(dataclasses.replace(small_layout, head_dim=32), cfg)
    with pytest.raises(LayoutMismatchError, match="chunk"):
        TieredStore(small_layout, dataclasses.replace(cfg, chunk_size=128))


def test_a_second_process_cannot_open_a_held_data_dir(tmp_path: Path, small_layout: KVLayout) -> None:
    cfg = StoreConfig(tiers=(TierName.DISK,), chunk_size=256, data_dir=tmp_path / "data", disk_capacity_bytes=64 << 20)
    code = (
        "import sys; from pathlib import Path; from kvstore import *; from kvstore.tiers.base import TierName\n"
        f"layout = KVLayout.from_json({small_layout.to_json()!r})\n"
        f"cfg = StoreConfig(tiers=(TierName.DISK,), chunk_size=256, data_dir=Path({str(tmp_path / 'data')!r}),"
        " disk_capacity_bytes=64 << 20)\n"
        "try:\n    TieredStore(layout, cfg)\nexcept StorageError as exc:\n    print('refused:', exc); sys.exit(3)\n"
    )
    with TieredStore(small_layout, cfg):
        result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 3, result.stderr
    assert "held by process" in result.stdout and str(os.getpid()) in result.stdout
    with pytest.raises(StorageError), TieredStore(small_layout, cfg), TieredStore(small_layout, cfg):
        pass


def test_deleting_lock_does_not_let_a_second_writer_in(tmp_path: Path, small_layout: KVLayout) -> None:
    """The owner lock is on the directory: removing the ``LOCK`` note leaves it held."""
    path = tmp_path / "data"
    cfg = StoreConfig(tiers=(TierName.DISK,), chunk_size=256, data_dir=path, disk_capacity_bytes=64 << 20)
    code = (
        "import sys; from pathlib import Path; from kvstore import *; from kvstore.tiers.base import TierName\n"
        f"layout = KVLayout.from_json({small_layout.to_json()!r})\n"
        f"cfg = StoreConfig(tiers=(TierName.DISK,), chunk_size=256, data_dir=Path({str(path)!r}),"
        " disk_capacity_bytes=64 << 20)\n"
        "try:\n    TieredStore(layout, cfg)\nexcept StorageError as exc:\n    print('refused:', exc); sys.exit(3)\n"
    )
    with TieredStore(small_layout, cfg) as store:
        (path / "LOCK").unlink()
        second = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
        assert second.returncode == 3, f"a second writer opened the dir: {second.stdout}{second.stderr[-500:]}"
        assert "held by another process" in second.stdout
        tokens, kv = make_tokens(512, seed=4), make_kv(small_layout, 512, seed=4)
        store.store(tokens, kv)
        store.flush()
    with TieredStore(small_layout, cfg) as store:  # once the writer is gone, the dir opens again
        assert torch.equal(store.retrieve(store.lookup(tokens)).kv, kv)
