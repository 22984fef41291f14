"""``kvstore bench server`` end to end with tiny sizes: every figure is measured against the in-process store and
every read is verified; with ``--kv-events``, each figure carries the publisher's share of the server's CPU."""

from __future__ import annotations

import json

import pytest

from kvstore.cli.main import main

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("events", [[], ["--kv-events"]], ids=["plain", "publishing-kv-events"])
def test_bench_server_json_rows(capsys: pytest.CaptureFixture[str], events: list[str]) -> None:
    argv = ["bench", "server", "--json", "--lookup-tokens", "512", "--lookups", "5", "--bulk-tokens", "64", *events]
    argv += ["--bulk-layout", "smollm2-135m", "--repeats", "1", "--chunk-size", "16"]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert exited.value.code == 0
    assert [(row["op"], row["unit"]) for row in rows] == [
        ("lookup", "ms"), ("store", "GB/s"), ("store", "GB/s"), ("retrieve", "GB/s"), ("retrieve", "GB/s")
    ]  # fmt: skip
    assert "32 segments" in rows[0]["note"] and rows[0]["num_samples"] == 5
    for row in rows:
        assert row["value"] > 0 and row["baseline_value"] > 0 and "DIFFER" not in row["note"]
        assert "in-process TieredStore" in row["baseline"]
        if events:  # the publisher's own CPU over the server's: a fraction, and said in the note
            share = row["kv_events_cpu_share"]
            assert 0 <= share < 1 and f"spent {share:.2%} of the server's CPU" in row["note"]
        else:
            assert row["kv_events_cpu_share"] is None and "publisher" not in row["note"]
