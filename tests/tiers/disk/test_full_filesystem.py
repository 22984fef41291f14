"""A full filesystem under the disk tier, on a real 24 MiB tmpfs: one warning per outage, the cpu tier keeps
serving, nothing committed is lost, and writes resume by themselves once space is freed -- cycle after cycle."""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstore import KVLayout, StoreConfig, TieredStore
from kvstore.layout import RopeSpec
from kvstore.store.inspection import check_data_dir
from kvstore.tiers.base import TierName, TierStats
from tests.factories import make_kv, make_tokens

LAYOUT = KVLayout(model_id="test/full-disk", num_layers=4, num_kv_heads=2, head_dim=64, rope=RopeSpec(theta=1e5))
"""2 KiB of bf16 KV a token: a 256-token chunk is 512 KiB of random (incompressible) bytes."""
SEQUENCE_TOKENS = 1024
FILESYSTEM_MIB = 24
FILLER_MIB = 8
CYCLES = 3


@pytest.fixture
def small_filesystem(tmp_path: Path) -> Iterator[Path]:
    mount_point = tmp_path / "fs"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={FILESYSTEM_MIB}m", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root, as on CI): {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def _grow(mount_point: Path, by_mib: int) -> None:
    """Give the tmpfs ``by_mib`` more (a volume grown by its operator)."""
    size_mib = os.statvfs(mount_point).f_blocks * os.statvfs(mount_point).f_frsize // 2**20
    subprocess.run(["mount", "-o", f"remount,size={size_mib + by_mib}m", str(mount_point)], check=True)


def _disk(store: TieredStore) -> TierStats:
    return next(tier for tier in store.stats().tiers if tier.tier is TierName.DISK)


def _store_sequences(store: TieredStore, seeds: range) -> None:
    for seed in seeds:
        store.store(make_tokens(SEQUENCE_TOKENS, seed=seed), make_kv(LAYOUT, SEQUENCE_TOKENS, seed=seed))
    store.flush()


def _messages(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [record for record in caplog.records if text in record.getMessage()]


def test_a_full_filesystem_warns_once_per_outage_and_heals_when_space_is_freed(
    small_filesystem: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    filler = small_filesystem / "filler"
    config = StoreConfig(
        tiers=(TierName.CPU, TierName.DISK),
        chunk_size=256,
        data_dir=small_filesystem / "data",
        disk_capacity_bytes=256 << 20,  # far above the filesystem: the filesystem fills first
        cpu_capacity_bytes=64 << 20,
    )
    with TieredStore(LAYOUT, config) as store:
        seed = 0
        for cycle in range(1, CYCLES + 1):
            _grow(small_filesystem, FILLER_MIB)  # room for a file the operator will delete below
            filler.write_bytes(b"\xff" * (FILLER_MIB << 20))
            before = _disk(store).num_chunks
            _store_sequences(store, range(seed, seed + 20))  # 40 MiB: more than the filesystem has left
            seed += 20
            on_disk = _disk(store).num_chunks
            assert on_disk - before < 20 * SEQUENCE_TOKENS // 256, "the filesystem never filled: this proves nothing"
            assert len(_messages(caplog, "the filesystem is full")) == cycle, "one warning per outage"
            latest = make_tokens(SEQUENCE_TOKENS, seed=seed - 1)
            result = store.retrieve(store.lookup(latest))
            assert torch.equal(result.kv, make_kv(LAYOUT, SEQUENCE_TOKENS, seed=seed - 1)), "the cpu tier serves"

            filler.unlink()  # the operator frees space: the next writes land, nothing is reopened
            _store_sequences(store, range(seed, seed + 2))
            seed += 2
            # the new chunks, and older ones the cpu tier spills to disk now that it takes writes again
            assert _disk(store).num_chunks >= on_disk + 2 * SEQUENCE_TOKENS // 256, "writes resumed by themselves"
            assert len(_messages(caplog, "writes resumed after")) == cycle
        assert not [record for record in caplog.records if record.exc_info], "no tracebacks for a full disk"
        assert not [record for record in caplog.records if record.levelno >= logging.ERROR]
        num_on_disk = _disk(store).num_chunks
    report = check_data_dir(config.data_dir)
    assert report.ok and report.num_chunks == num_on_disk, report.problems
