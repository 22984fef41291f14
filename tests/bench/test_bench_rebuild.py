"""``kvstore bench rebuild`` at a small size: a verified JSON row, the data dir reused, foreign dirs refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore.bench.rebuild import MANIFEST_NAME, RebuildBenchOptions, run_rebuild_benchmark
from kvstore.cli.main import main
from kvstore.errors import ConfigError

FIELDS = (
    "chunks", "rebuild_s", "read_records_s", "disk_open_s", "rebuild_one_pass_s", "rebuild_gc_s", "rebuild_cpu_s",
    "chunks_per_s", "index_entries", "recall", "doc_coverage", "false_positives", "baseline",
    "rebuild_to_baseline_ratio", "target_chunks_per_s", "met", "build_s", "reused_data_dir", "data_dir_bytes",
    "lookup_ms_median",
)  # fmt: skip


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    captured = capsys.readouterr()
    code = exited.value.code
    return (code if isinstance(code, int) else 0), captured.out, captured.err


def test_the_command_prints_a_verified_row_and_reuses_its_data_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data_dir = tmp_path / "rebuild"
    argv = ["bench", "rebuild", "--chunks", "2400", "--data-dir", str(data_dir), "--queries", "20", "--repeats", "1"]

    code, out, _ = run_cli([*argv, "--json"], capsys)

    assert code == 0
    (row,) = [json.loads(line) for line in out.splitlines()]
    assert row["bench"] == "index_rebuild" and all(name in row for name in FIELDS)
    assert row["chunks"] == row["index_entries"] == 2400 and row["documents"] == 200
    assert row["recall"] == 1.0 and row["doc_coverage"] == 1.0 and row["false_positives"] == 0
    assert row["reused_data_dir"] is False and row["build_s"] > 0 and row["data_dir"] == str(data_dir)
    assert row["rebuild_s"] > 0 and row["read_records_s"] > 0 and row["rebuild_one_pass_s"] > 0
    rounding_s = 0.0005  # rebuild_s is rounded to the millisecond (an open of 2400 chunks takes a few)
    assert 2400 / (row["rebuild_s"] + rounding_s) <= row["chunks_per_s"] <= 2400 / (row["rebuild_s"] - rounding_s)
    assert (data_dir / MANIFEST_NAME).exists()

    code, out, _ = run_cli(argv, capsys)  # the plain output: name=value pairs, the data dir reused
    assert code == 0 and "reused_data_dir=True" in out and "build_s=None" in out and "recall=1.0" in out


def test_a_changed_workload_rebuilds_its_own_data_dir(tmp_path: Path) -> None:
    options = RebuildBenchOptions(num_chunks=60, data_dir=tmp_path / "data", num_queries=3, num_repeats=1)
    assert run_rebuild_benchmark(options).reused_data_dir is False
    reseeded = RebuildBenchOptions(num_chunks=60, data_dir=tmp_path / "data", num_queries=3, num_repeats=1, seed=1)
    row = run_rebuild_benchmark(reseeded)
    assert row.reused_data_dir is False and row.recall == 1.0 and row.index_entries == 60


def test_a_directory_it_did_not_build_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "precious.txt").write_text("keep me")
    code, _, err = run_cli(["bench", "rebuild", "--chunks", "60", "--data-dir", str(tmp_path)], capsys)
    assert code == 1 and "not built by kvstore bench rebuild" in err and "Traceback" not in err
    assert (tmp_path / "precious.txt").read_text() == "keep me"


@pytest.mark.parametrize("changes", [{"num_chunks": 0}, {"num_queries": 0}, {"num_repeats": 0}, {"head_dim": 0}])
def test_bad_options_raise_config_error(changes: dict[str, int]) -> None:
    with pytest.raises(ConfigError):
        RebuildBenchOptions(**changes)  # type: ignore[arg-type]
