"""A request's prompt is counted once, however many times its engine looks it up.

vLLM's connector probes a prompt on the scheduler, then plans it again pinned (or the worker's blend pass looks it up
again): each such repeat passes ``repeat=True``. ``kvstore inspect --url`` once reported 6,924 tokens looked up (33%
never stored) after two chat requests whose prompts held 4,616 (50%), counting the probe and the repeat both.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvstore import Client, StoreConfig, TieredStore
from kvstore.tiers.base import TierName
from tests.server.conftest import CHUNK_SIZE, SERVER_LAYOUT, ServerProcess, running_server

STORED = list(range(100, 100 + 4 * CHUNK_SIZE))
PROMPT = STORED + list(range(9000, 9000 + 4 * CHUNK_SIZE))  # half stored, half never


def _kv(num_tokens: int) -> torch.Tensor:
    return torch.randn(SERVER_LAYOUT.chunk_shape(num_tokens)).to(torch.bfloat16)


def test_a_repeated_lookup_plans_the_same_and_is_not_counted_again(tmp_path: Path) -> None:
    with TieredStore(SERVER_LAYOUT, StoreConfig(tiers=("cpu",), chunk_size=CHUNK_SIZE)) as store:
        store.store(STORED, _kv(len(STORED)))
        first = store.lookup(PROMPT)
        store.release(first)
        counted = store.stats()
        again = store.lookup(PROMPT, repeat=True)
        assert [(s.start, s.key) for s in again.segments] == [(s.start, s.key) for s in first.segments]
        store.release(again)
        after = store.stats()
    assert after.lookups == counted.lookups
    assert after.tier(TierName.CPU).hits == counted.tier(TierName.CPU).hits
    assert counted.lookups.looked_up_tokens == len(PROMPT)
    assert sum(counted.lookups.missed_tokens.values()) == len(PROMPT) - len(STORED)


def _looked_up(server: ServerProcess) -> tuple[int, int]:
    with Client(server.url) as admin:
        lookups = admin.stats().lookups
    return lookups.looked_up_tokens, sum(lookups.missed_tokens.values())


def test_the_server_counts_a_request_once_through_a_probe_and_a_pinned_repeat(tmp_path: Path) -> None:
    with running_server(tmp_path / "data") as server, Client(server.url, SERVER_LAYOUT) as client:
        client.store(STORED, _kv(len(STORED)), durable=False)
        for _ in range(2):  # two requests, each as the connector makes it: a probe, then a pinned repeat
            probe = client.lookup(PROMPT, pin=False)
            pinned = client.lookup(PROMPT, repeat=True)
            assert pinned.num_prefix_tokens == probe.num_prefix_tokens == len(STORED)
            client.release(pinned)
        looked_up, missed = _looked_up(server)
    assert looked_up == 2 * len(PROMPT) and missed == 2 * (len(PROMPT) - len(STORED))
