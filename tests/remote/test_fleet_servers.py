"""``kvstore serve`` processes as the hosts of a fleet, sharing one real Valkey: what a client stores through one
server, a client of another gets bit-identical, by prefix and at a new position, and with Valkey killed every
request still succeeds."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.bench.remote_fleet import lookup_when_known
from kvstore.bench.valkey_server import ValkeyServer
from kvstore.client import Client
from kvstore.tiers.base import TierName
from tests.factories import make_kv, make_tokens
from tests.server.conftest import CHUNK_SIZE, SERVER_LAYOUT, ServerProcess, running_server


@pytest.fixture
def fleet(tmp_path: Path, valkey: ValkeyServer) -> Iterator[list[ServerProcess]]:
    remote = ("--tiers", "cpu,disk,remote", "--remote-url", valkey.url, "--enable-blend", "--remote-timeout-ms", "200")
    with running_server(tmp_path / "host1", *remote) as first, running_server(tmp_path / "host2", *remote) as second:
        yield [first, second]


def test_a_document_stored_through_one_server_is_served_by_another(
    fleet: list[ServerProcess], valkey: ValkeyServer
) -> None:
    document = make_tokens(6 * CHUNK_SIZE + 5, seed=1)
    kv = make_kv(SERVER_LAYOUT, len(document), seed=1)
    with Client(fleet[0].url, SERVER_LAYOUT) as first, Client(fleet[1].url, SERVER_LAYOUT) as second:
        first.store(document, kv)
        first.flush()
        plan = lookup_when_known(second, document, len(document))
        assert [segment.tier for segment in plan.segments] == [TierName.REMOTE] * 7
        assert torch.equal(second.retrieve(plan).kv, kv)

        prompt = np.concatenate([make_tokens(11, seed=2), document])
        moved = second.retrieve(second.lookup(prompt))
        assert [(s.start - 11, s.exact) for s in moved.segments] == [(s.source_start, False) for s in moved.segments]
        assert len(moved.segments) == 7
        for segment in moved.segments:
            source = slice(segment.source_start, segment.source_start + segment.num_tokens)
            assert torch.equal(moved.kv[:, :, segment.start : segment.end], kv[:, :, source])
        assert second.stats().tier(TierName.REMOTE) is not None

        valkey.kill()
        for index in range(8):  # every request still succeeds: the servers serve from their own tiers
            tokens = make_tokens(3 * CHUNK_SIZE, seed=10 + index)
            fresh = make_kv(SERVER_LAYOUT, len(tokens), seed=10 + index)
            for client in (first, second):
                client.store(tokens, fresh)
                assert torch.equal(client.retrieve(client.lookup(tokens)).kv, fresh)
            assert torch.equal(first.retrieve(first.lookup(document)).kv, kv)
        first.flush()
    for server in fleet:
        assert server.process.poll() is None
        log = server.stderr()
        assert log.count("unreachable") == 1 and "Traceback" not in log


def test_the_remote_is_reported_in_stats_and_metrics(tmp_path: Path, valkey: ValkeyServer) -> None:
    # 1 s a round trip: 200 ms timed out the first writes on a loaded CI host; a killed Valkey refuses at once anyway
    remote = ("--tiers", "cpu,disk,remote", "--remote-url", valkey.url, "--remote-timeout-ms", "1000")
    with running_server(tmp_path / "host", *remote) as server, Client(server.url, SERVER_LAYOUT) as client:
        tokens = make_tokens(2 * CHUNK_SIZE, seed=30)
        client.store(tokens, make_kv(SERVER_LAYOUT, len(tokens), seed=30))
        client.flush()
        stats = client.stats()
        remote = stats.remote
        assert remote is not None and remote.available and remote.outages == 0
        assert stats.tier(TierName.REMOTE) is not None and stats.tier(TierName.REMOTE).puts == 2
        inspected = subprocess.run(
            [sys.executable, "-m", "kvstore.cli.main", "inspect", "--url", server.url],
            capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"},
        )  # fmt: skip
        assert inspected.returncode == 0 and "reachable, 0 outages" in inspected.stdout
        assert "Valkey's" in inspected.stdout
        valkey.kill()
        client.store(make_tokens(CHUNK_SIZE, seed=31), make_kv(SERVER_LAYOUT, CHUNK_SIZE, seed=31))
        client.flush()
        down = client.stats().remote
        assert down is not None and not down.available and down.outages == 1 and down.failed_calls >= 1
        with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
            exposition = response.read().decode()
    assert "kvstore_remote_available 0.0" in exposition and "kvstore_remote_outages_total 1.0" in exposition
    assert 'kvstore_tier_puts_total{tier="remote"} 2.0' in exposition
