"""Miss reasons through a real server: the plan's and the retrieve's misses cross the wire intact, the totals reach
``/metrics`` and ``kvstore inspect --url``, and they add up to the gap tokens the server counted."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvstore import Client
from kvstore.cli.main import main
from kvstore.keys import prefix_keys
from kvstore.misses import MissReason, tokens_by_reason
from tests.factories import make_kv, make_tokens
from tests.server.conftest import CHUNK_SIZE, SERVER_LAYOUT, running_server
from tests.server.test_client_store_tail import scrape

pytestmark = pytest.mark.slow


def test_reasons_cross_the_wire_and_add_up_in_metrics_and_inspect(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with running_server(tmp_path / "data", "--tiers", "cpu") as server:
        stored = make_tokens(4 * CHUNK_SIZE, seed=61)
        with Client(server.url, SERVER_LAYOUT, name="misses") as client:
            client.store(stored, make_kv(SERVER_LAYOUT, len(stored), seed=61))
            client.evict([prefix_keys(SERVER_LAYOUT.namespace, stored, CHUNK_SIZE)[2]])
            prompt = np.concatenate([stored, make_tokens(5, seed=62)])
            plan = client.lookup(prompt)
            assert [(m.start, m.end, m.reason) for m in plan.misses] == [
                (2 * CHUNK_SIZE, 3 * CHUNK_SIZE, MissReason.EVICTED_CPU),
                (3 * CHUNK_SIZE, 4 * CHUNK_SIZE, MissReason.BEHIND_GAP),
                (4 * CHUNK_SIZE, len(prompt), MissReason.NEVER_STORED),
            ]
            result = client.retrieve(plan, start=CHUNK_SIZE)
            assert result.misses == plan.misses and result.num_prefix_tokens == 2 * CHUNK_SIZE
            cold = client.lookup(make_tokens(3 * CHUNK_SIZE, seed=63), pin=False)
            assert tokens_by_reason(cold.misses) == {MissReason.NEVER_STORED: 3 * CHUNK_SIZE}
            totals = client.stats().lookups
        assert totals.looked_up_tokens == len(prompt) + 3 * CHUNK_SIZE
        expected = {"evicted_cpu": CHUNK_SIZE, "behind_gap": CHUNK_SIZE, "never_stored": 3 * CHUNK_SIZE + 5}
        assert totals.missed_tokens == expected
        metrics = scrape(server)
        for reason, count in expected.items():
            assert metrics[f'kvstore_missed_tokens_total{{reason="{reason}"}}'] == count
        assert metrics['kvstore_lookup_tokens_total{kind="gap"}'] == sum(expected.values())
        with pytest.raises(SystemExit) as exited:
            main(["inspect", "--url", server.url, "--json"])
        report = json.loads(capsys.readouterr().out)
        assert exited.value.code in (0, None)
        assert report["lookups"] == {"looked_up_tokens": totals.looked_up_tokens, "missed_tokens": expected}
        with pytest.raises(SystemExit):
            main(["inspect", "--url", server.url])
        out = capsys.readouterr().out
        assert "missed tokens by reason" in out and "evicted_cpu" in out and "never_stored" in out
