"""The tier benchmark at a tiny size: rows are well formed, reads are verified, a broken tier is caught."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvstore.bench.tiers import TierBenchOptions, TierBenchRow, run_tier_benchmark
from kvstore.errors import ConfigError
from kvstore.presets import preset_layout
from kvstore.tiers.arena import ArenaTier
from kvstore.tiers.base import TierName

KIB = 1024
CHUNK_TOKENS = 8  # 180 KiB chunks of the SmolLM2 layout


def tiny_options(tmp_path: Path, *tiers: TierName) -> TierBenchOptions:
    return TierBenchOptions(
        layouts=("smollm2-135m",),
        tiers=tiers,
        chunk_size=CHUNK_TOKENS,
        memory_bytes=2048 * KIB,
        gpu_memory_bytes=2048 * KIB,
        disk_bytes=2048 * KIB,
        source_bytes=512 * KIB,
        num_repeats=2,
        num_disk_repeats=2,
        directory=tmp_path,
        device="cpu",
    )


def check_row(row: TierBenchRow) -> None:
    assert row.GBps > 0 and row.baseline_GBps > 0
    assert row.ratio == pytest.approx(row.GBps / row.baseline_GBps)
    assert row.met == (row.ratio >= row.target_ratio and row.verified is not False)
    assert row.chunk_bytes == preset_layout("smollm2-135m").chunk_bytes(CHUNK_TOKENS)
    assert row.num_chunks == 2048 * KIB // row.chunk_bytes
    assert row.num_repeats == 2
    assert row.baseline and row.note
    decoded = json.loads(json.dumps(row.to_json_dict()))
    for name in ("tier", "layout", "op", "GBps", "baseline", "baseline_GBps", "ratio", "target_ratio", "met",
                 "compression_ratio", "num_chunks", "chunk_bytes", "p50_ms", "p90_ms", "p99_ms", "max_ms"):
        assert name in decoded
    assert decoded["tier"] == row.tier.value


def test_every_tier_yields_verified_rows(tmp_path: Path) -> None:
    messages: list[str] = []
    options = tiny_options(tmp_path, TierName.GPU, TierName.CPU, TierName.DISK)
    rows = list(run_tier_benchmark(options, messages.append))

    assert [(row.tier.value, row.op) for row in rows] == [
        ("gpu", "put"), ("gpu", "get"), ("gpu", "promote_from_cpu"),
        ("cpu", "put"), ("cpu", "get"),
        ("disk", "put"), ("disk", "get_cold"), ("disk", "get_cold_prefetch"),
    ]  # fmt: skip
    for row in rows:
        check_row(row)
        if row.op != "put" or row.tier is TierName.DISK:
            assert row.verified is True, f"{row.tier} {row.op} lost or changed data"
        else:
            assert row.verified is None
    memory_rows = [row for row in rows if row.tier is not TierName.DISK]
    for row in memory_rows:
        assert row.p50_ms is not None and row.p90_ms is not None and row.p99_ms is not None
        assert row.max_ms is not None
        assert 0 < row.p50_ms <= row.p90_ms <= row.p99_ms <= row.max_ms
    disk_put, disk_get, disk_prefetch_get = rows[-3:]
    assert disk_put.p50_ms is None, "a disk put only queues: no per-chunk latency"
    assert disk_prefetch_get.baseline_GBps == disk_get.baseline_GBps, "both reads share the baseline samples"
    for row in (disk_get, disk_prefetch_get):
        assert row.p50_ms is not None and row.max_ms is not None and 0 < row.p50_ms <= row.max_ms
    for row in (disk_put, disk_get, disk_prefetch_get):
        assert row.compression_ratio is not None and row.compression_ratio >= 1.0
    for row in (disk_put, disk_get, disk_prefetch_get):
        assert row.cpu_cores is not None and row.cpu_cores > 0
        assert row.baseline_cpu_cores is not None and row.baseline_cpu_cores > 0
        split = (row.user_core_s_per_GB, row.sys_core_s_per_GB)
        baseline_split = (row.baseline_user_core_s_per_GB, row.baseline_sys_core_s_per_GB)
        assert all(value is not None and value >= 0 for value in (*split, *baseline_split))
        assert sum(split) > 0 and sum(baseline_split) > 0  # type: ignore[arg-type]  # None ruled out above
    assert all(row.cpu_cores is None and row.user_core_s_per_GB is None for row in memory_rows), "disk rows only"
    assert any("disk" in message for message in messages)
    assert list(tmp_path.iterdir()) == [], "the benchmark must remove its data dirs"


def test_wrong_bytes_fail_verification(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ArenaTier, "get_into", lambda self, key, out: True)  # claims a hit, copies nothing

    put, get = run_tier_benchmark(tiny_options(tmp_path, TierName.CPU))

    assert put.verified is None
    assert get.verified is False and get.met is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_gpu_tier_is_skipped_with_a_note_without_cuda(tmp_path: Path) -> None:
    messages: list[str] = []
    options = TierBenchOptions(layouts=("smollm2-135m",), tiers=(TierName.GPU,), device="cuda")

    assert list(run_tier_benchmark(options, messages.append)) == []
    assert any("gpu tier skipped" in message for message in messages)


@pytest.mark.parametrize("changes", [{"layouts": ("gpt-17",)}, {"disk_bytes": 0}, {"num_repeats": 0}])
def test_bad_options_raise_config_error(changes: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        TierBenchOptions(**changes)  # type: ignore[arg-type]
