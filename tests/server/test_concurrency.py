"""8 client processes running mixed operations against one server for a bounded time: no deadlock, every read
correct, no pin or shared-memory segment left behind, bounded server memory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore import Client
from tests.server.conftest import REPO_ROOT, running_server, segments_mapped

pytestmark = pytest.mark.slow

NUM_CLIENTS = 8
RUN_SECONDS = 6.0


def private_memory_bytes(pid: int) -> int:
    """Anonymous (private) resident memory of a process: what it allocated itself, not mapped files or shm."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/PID/status")


def test_eight_clients_with_mixed_operations(tmp_path: Path) -> None:
    with running_server(tmp_path / "data", "--enable-blend", "--workers", "4") as server:
        with Client(server.url) as admin:
            admin.info()
        memory_before = private_memory_bytes(server.pid)
        launcher = subprocess.Popen(
            [sys.executable, "-m", "tests.server.mixed_client", server.url, str(NUM_CLIENTS), str(RUN_SECONDS)],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        out, err = launcher.communicate(timeout=RUN_SECONDS + 120)
        assert launcher.returncode == 0, f"a client failed (deadlock or error?): {err[-3000:]}"
        results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert len(results) == NUM_CLIENTS
        memory_after = private_memory_bytes(server.pid)
        assert all(result["retrieve"] > 0 and result["store"] > 0 for result in results), results
        assert sum(result["checked_tokens"] for result in results) > 0
        with Client(server.url, name="kvstore admin") as admin:
            stats = admin.stats()
            assert stats.num_open_plans == 0 and stats.num_sessions == 0, "pins leaked"
            assert all(tier.num_pinned == 0 for tier in stats.tiers if tier.tier.value != "disk")
            assert [c.name for c in admin.info().clients] == ["kvstore admin"], "every client said goodbye"
            assert admin.health().status == "serving"
        for result in results:
            assert segments_mapped(server.pid, result["pid"]) == 0, "the server still maps a gone client's segments"
        growth = memory_after - memory_before
        assert growth < 256 * 2**20, f"server private memory grew by {growth / 2**20:.0f} MiB"
    assert "Traceback" not in server.stderr()
