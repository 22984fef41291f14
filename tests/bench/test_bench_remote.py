"""``kvstore bench remote`` end to end with small sizes against the real Valkey it starts: every part's figures
are measured and its checks hold (bit-identical serving, recall, no failed request with Valkey killed)."""

from __future__ import annotations

import json

import pytest

from kvstore.cli.main import main

pytestmark = pytest.mark.slow


def _rows(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[dict[str, object]]:
    with pytest.raises(SystemExit) as exited:
        main(["bench", "remote", "--json", *argv])
    assert exited.value.code == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_throughput_and_directory_rows(capsys: pytest.CaptureFixture[str]) -> None:
    rows = _rows(["--parts", "throughput,directory", "--chunks", "1200", "--throughput-chunks", "2",
                  "--repeats", "2"], capsys)  # fmt: skip
    throughput = [row for row in rows if row["part"] == "throughput"]
    assert [row["op"] for row in throughput] == ["put_frames", "get_frames", "put_chunks", "get_chunks"]
    for row in throughput:
        assert row["gb_per_s"] > 0 and row["baseline_gb_per_s"] > 0
        assert row["ratio"] == pytest.approx(row["gb_per_s"] / row["baseline_gb_per_s"])
    (directory,) = [row for row in rows if row["part"] == "directory"]
    assert directory["chunks"] == 1200 and directory["recall"] == 1.0 and directory["query_tokens"] == 15066
    assert 0 < directory["directory_bytes_per_chunk"] < 200 and directory["lookup_ms_p50"] > 0


def test_fleet_rows(capsys: pytest.CaptureFixture[str]) -> None:
    (row,) = _rows(["--parts", "fleet", "--hosts", "2", "--run-s", "3"], capsys)
    assert row["prefix_identical"] and row["moved_identical"] and row["servers_alive"]
    assert row["failed_requests"] == 0 and row["requests"] > 0 and row["tracebacks"] == 0
    assert row["outage_log_lines"] == 2 and row["met"]


def test_bad_arguments_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--parts", "nope"], ["--parts", "fleet", "--remote-url", "valkey://x"], ["--hosts", "1"]):
        with pytest.raises(SystemExit) as exited:
            main(["bench", "remote", *argv])
        assert exited.value.code != 0
        error = capsys.readouterr().err.strip()
        assert error and "\n" not in error and "Traceback" not in error
