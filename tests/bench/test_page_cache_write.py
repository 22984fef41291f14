"""benchmarks/page_cache_write.py runs, reports both modes and leaves nothing behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "page_cache_write.py"


def test_reports_every_write_and_a_median_per_mode(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--total-mib", "4", "--repeats", "2", "--scratch-dir", str(tmp_path)],
        capture_output=True, text=True, check=True, timeout=120,
    )
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    writes = [row for row in rows if "summary" not in row]
    medians = {row["mode"]: row for row in rows if row.get("summary") == "median"}
    assert sorted((row["mode"], row["repeat"]) for row in writes) == [
        ("growing", 0), ("growing", 1), ("recycled", 0), ("recycled", 1)
    ]
    assert all(row["GBps"] > 0 and row["sys_core_s_per_GB"] >= 0 for row in writes)
    assert set(medians) == {"recycled", "growing"}
    assert list(tmp_path.iterdir()) == []  # its files are gone


def test_rejects_a_non_positive_size(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--total-mib", "0", "--scratch-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode != 0
    assert "--total-mib and --repeats must be positive" in result.stderr
    assert "Traceback" not in result.stderr
