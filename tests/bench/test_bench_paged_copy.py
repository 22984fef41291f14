"""benchmarks/bench_paged_copy.py at a tiny size on CPU: every variant is verified and its rows are well formed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # three subprocesses, each importing torch and kvstore

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_paged_copy.py"
TINY = ["--device", "cpu", "--layers", "2", "--kv-heads", "2", "--head-dim", "16", "--block-size", "4"]
TINY += ["--tokens", "32", "--pool-blocks", "16", "--warmup", "1", "--repeats", "3"]


def run_script(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *arguments], capture_output=True, text=True, timeout=240, check=False
    )


def test_every_layout_and_variant_is_verified_and_compared_with_the_copy_baseline() -> None:
    result = run_script(*TINY, "--json")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]

    expected = []
    for layout in ("LBNHC", "LBHNC"):
        expected.append((layout, "baseline", "copy", "eager"))
        for variant in ("current", "current_layerwise"):  # the connector's copies, also bound beforehand
            for op in ("gather", "scatter"):
                expected += [(layout, variant, op, "eager"), (layout, variant, op, "eager_prepared")]
        for variant in ("wide16", "wide16_fused", "whole_block"):  # no triton on CPU
            expected += [(layout, variant, "gather", "eager"), (layout, variant, "scatter", "eager")]
    assert [(row["layout"], row["variant"], row["op"], row["mode"]) for row in rows] == expected
    payload_bytes = 2 * 2 * 32 * 2 * 16 * 2  # layers x planes x tokens x heads x head_dim x 2 bytes
    for row in rows:
        assert row["verified"] is True, row
        assert row["device"] == "cpu" and row["dtype"] == "bfloat16"
        assert row["payload_bytes"] == payload_bytes and row["num_repeats"] == 3
        assert row["GBps"] > 0 and row["baseline_GBps"] > 0
        assert row["ratio"] == pytest.approx(row["GBps"] / row["baseline_GBps"], rel=2e-3)
        assert row["target_ratio"] == 0.8 and row["met"] == (row["ratio"] >= 0.8)
        assert 0 < row["p50_ms"] <= row["p90_ms"] <= row["p99_ms"] <= row["max_ms"]
        assert "copy_" in row["baseline"]


def test_a_table_without_json() -> None:
    result = run_script(*TINY, "--layouts", "LBHNC", "--variants", "current")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:4] == ["layout", "variant", "mode", "op"]
    assert [line.split()[:4] for line in lines[1:]] == [
        ["LBHNC", "baseline", "eager", "copy"],
        ["LBHNC", "current", "eager", "gather"],
        ["LBHNC", "current", "eager_prepared", "gather"],
        ["LBHNC", "current", "eager", "scatter"],
        ["LBHNC", "current", "eager_prepared", "scatter"],
    ]
    assert all(line.endswith("yes") for line in lines[1:])


def test_a_request_that_is_not_whole_blocks_is_refused_in_one_line() -> None:
    result = run_script(*TINY[: TINY.index("--tokens")], "--tokens", "30", "--pool-blocks", "16")
    assert result.returncode != 0
    assert "must be a multiple of --block-size 4" in result.stderr
    assert "Traceback" not in result.stderr
