"""kill -9 of a server during a durable write storm, then a restart: every chunk it acknowledged as durable is
served, bit for bit, and the data dir has no defect.

"Acknowledged as durable" is a reply to ``store(..., durable=True)`` (or to ``flush()`` after a plain store): the
server answers only after the disk tier committed and synced the chunks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvstore import Client
from kvstore.store.inspection import check_data_dir
from tests.server.conftest import REPO_ROOT, SERVER_LAYOUT, running_server
from tests.server.storm_client import TOKENS_PER_SEQUENCE, sequence

pytestmark = pytest.mark.slow


def test_kill_9_during_a_write_storm_loses_nothing_acknowledged(tmp_path: Path) -> None:
    data = tmp_path / "data"
    acknowledged = 0
    with running_server(data) as server, subprocess.Popen(
        [sys.executable, "-m", "tests.server.storm_client", server.url],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    ) as storm:
        assert storm.stdout is not None
        deadline = time.monotonic() + 60
        while acknowledged < 40 and time.monotonic() < deadline:
            line = storm.stdout.readline()
            if line.startswith("durable "):
                acknowledged = int(line.split()[1])
        os.kill(server.pid, signal.SIGKILL)  # mid-storm: the client keeps storing
        server.process.wait()
        for line in storm.stdout:  # acknowledgements that raced the kill still count
            if line.startswith("durable "):
                acknowledged = int(line.split()[1])
        storm.wait(30)
    assert acknowledged >= 40, "the storm did not get going"

    with running_server(data) as restarted, Client(restarted.url, SERVER_LAYOUT) as client:
        for seed in range(acknowledged + 8):
            tokens, kv = sequence(seed)
            result = client.retrieve(client.lookup(tokens))
            assert torch.equal(result.kv, kv[:, :, : result.num_prefix_tokens]), f"sequence {seed} read back different"
            if seed < acknowledged:
                assert result.num_prefix_tokens == TOKENS_PER_SEQUENCE, f"acknowledged sequence {seed} lost"
        assert all(tier.corrupt_reads == 0 for tier in client.stats().tiers)
    report = check_data_dir(data)
    assert report.ok and report.num_unfinished_frames == 0, report.problems
