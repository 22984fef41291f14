"""``kvstore serve --kv-events``: a consumer of the event stream rebuilds the server's exact residency, tier by tier,
through an eviction-heavy run, a late join (snapshot + replay) and a restart (real server processes, real ZeroMQ
sockets; events decoded with plain msgpack here, with vLLM's own structs in
``tests/vllm/connectors/test_kv_events_vllm.py``).
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from kvstore import Client
from kvstore.keys import PrefixKey, as_token_array, prefix_keys
from kvstore.server.kv_events.consumer import ResidencyMirror, Subscriber, free_port, join_late
from kvstore.server.kv_events.encoding import MEDIUMS
from kvstore.tiers.base import TierName
from tests.factories import make_kv, make_tokens
from tests.server.conftest import CHUNK_SIZE, SERVER_LAYOUT, ServerProcess, running_server

pytestmark = pytest.mark.slow

NUM_DOCUMENTS = 120
"""Of 2 to 12 chunks each (about 800 chunks, 3 MiB of KV): several times what the cpu and disk tiers hold."""


def documents(seed: int) -> list[npt.NDArray[np.int64]]:
    rng = np.random.default_rng(seed)
    return [
        make_tokens(int(rng.integers(2, 13)) * CHUNK_SIZE + int(rng.integers(0, CHUNK_SIZE)), seed=seed * 1000 + index)
        for index in range(NUM_DOCUMENTS)
    ]


def keys_of(tokens: npt.NDArray[np.int64]) -> list[PrefixKey]:
    return prefix_keys(SERVER_LAYOUT.namespace, as_token_array(tokens), CHUNK_SIZE)


def residency(client: Client, keys: list[PrefixKey]) -> set[tuple[str, bytes]]:
    """The server's own answer: every (medium, key) it holds, asked chunk by chunk."""
    return {(MEDIUMS[tier], key) for key in keys for tier in client.chunk(key).tiers}


@pytest.fixture
def events_server(tmp_path: Path) -> Iterator[tuple[ServerProcess, Subscriber]]:
    replay = f"tcp://127.0.0.1:{free_port()}"
    subscriber = Subscriber(ResidencyMirror(), replay)
    flags = ("--tiers", "cpu,disk", "--cpu-size", "96KiB", "--disk-size", "1MiB")
    flags += ("--kv-events", subscriber.endpoint, "--kv-events-replay", replay, "--kv-events-topic", "kvstore")
    try:
        with running_server(tmp_path / "data", *flags) as server:
            yield server, subscriber
    finally:
        subscriber.close()


def test_a_subscriber_and_a_late_joiner_rebuild_the_exact_residency_through_an_eviction_heavy_run(
    events_server: tuple[ServerProcess, Subscriber],
) -> None:
    server, subscriber = events_server
    stored = documents(seed=1)
    all_keys = [key for tokens in stored for key in keys_of(tokens)]
    with Client(server.url, SERVER_LAYOUT) as client:
        for index, tokens in enumerate(stored):
            client.store(tokens, make_kv(SERVER_LAYOUT, len(tokens), seed=index))
            if index % 3 == 0:  # a hit on an older document promotes it from the disk back into the cpu tier
                older = stored[index // 2]
                client.retrieve(client.lookup(older))
            if index % 17 == 0:
                client.evict(keys_of(stored[index // 3])[:2])
        client.evict_bytes(32 * 1024, "cpu")
        client.flush()
        subscriber.receive(quiet_s=1.5)
        truth = residency(client, all_keys)
        stats = client.stats()
    cpu, disk = stats.tier(TierName.CPU), stats.tier(TierName.DISK)
    assert cpu is not None and disk is not None and cpu.evictions > 100 and disk.evictions > 100, "eviction-heavy"
    mirror = subscriber.mirror
    assert mirror.cleared == 1, "batch 0 clears what a consumer held of an earlier run"
    assert mirror.resident - truth == set(), "no phantom blocks"
    assert truth - mirror.resident == set(), "no missing blocks"
    assert {medium for medium, _ in truth} == {"CPU", "STORAGE"}

    first = keys_of(stored[5])
    block = mirror.stored[first[1]]
    assert block.parent_block_hash == first[0] and block.block_size == CHUNK_SIZE
    assert block.token_ids.tolist() == stored[5][CHUNK_SIZE : 2 * CHUNK_SIZE].tolist()
    assert mirror.stored[first[0]].parent_block_hash is None

    late = ResidencyMirror()
    join_late(subscriber.replay_endpoint, late)
    assert late.resident == truth, "a snapshot and the batches after it are the residency"
    resident_key = min(key for _, key in truth)
    assert late.stored[resident_key].token_ids.tolist() == mirror.stored[resident_key].token_ids.tolist() != []
    by_keys = ResidencyMirror()
    join_late(subscriber.replay_endpoint, by_keys, with_tokens=False)
    assert by_keys.resident == truth and by_keys.stored[resident_key].token_ids.size == 0
    metrics = scrape(server.metrics_url)
    assert metrics['kvstore_kv_events_requests_total{kind="snapshot"}'] == 2
    assert metrics['kvstore_kv_events_total{type="BlockStored"}'] >= len(all_keys)
    # a batch's removals from one tier travel as one event: fewer events than the 200+ evictions, never none
    removed_events = metrics['kvstore_kv_events_total{type="BlockRemoved"}']
    assert 0 < removed_events < cpu.evictions + disk.evictions and metrics["kvstore_kv_events_queued"] == 0
    assert metrics["kvstore_kv_events_batches_total"] == mirror.last_seq + 1
    assert metrics["kvstore_kv_events_cpu_seconds_total"] > 0, "the publisher's thread reports what it spent"


def scrape(metrics_url: str) -> dict[str, float]:
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        lines = response.read().decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line[:1] != "#"}


def test_a_restarted_server_clears_then_publishes_what_its_disk_recovered(tmp_path: Path) -> None:
    replay = f"tcp://127.0.0.1:{free_port()}"
    stored = documents(seed=2)[:20]
    all_keys = [key for tokens in stored for key in keys_of(tokens)]
    flags = ("--tiers", "cpu,disk", "--kv-events-replay", replay)
    first_run = running_server(tmp_path / "data", *flags, "--kv-events", f"tcp://127.0.0.1:{free_port()}")
    with first_run as server, Client(server.url, SERVER_LAYOUT) as client:
        for index, tokens in enumerate(stored):
            client.store(tokens, make_kv(SERVER_LAYOUT, len(tokens), seed=index))
        client.flush()
    subscriber = Subscriber(ResidencyMirror(), replay)
    subscriber.mirror.resident.add(("CPU", b"\x00" * 16))  # what the consumer held of the last run
    try:
        with running_server(tmp_path / "data", *flags, "--kv-events", subscriber.endpoint) as server:
            subscriber.receive(quiet_s=1.5)
            with Client(server.url, SERVER_LAYOUT) as client:
                truth = residency(client, all_keys)
    finally:
        subscriber.close()
    assert {medium for medium, _ in truth} == {"STORAGE"} and len(truth) == len(set(all_keys))
    assert subscriber.mirror.cleared == 1 and subscriber.mirror.resident == truth


def test_kv_event_flags_are_checked_with_one_line_errors(tmp_path: Path) -> None:
    from kvstore.errors import ConfigError
    from kvstore.server.host_facts import probe_host
    from kvstore.server.settings import ServeFlags, resolve_settings

    with pytest.raises(ConfigError, match="--kv-events: server URL 'localhost:5557' must look like"):
        resolve_settings(ServeFlags(tiers="cpu", kv_events="localhost:5557"), probe_host())
    with pytest.raises(ConfigError, match="need --kv-events"):
        resolve_settings(ServeFlags(tiers="cpu", kv_events_replay="tcp://*:5558"), probe_host())
    with pytest.raises(ConfigError, match="need --kv-events"):
        resolve_settings(ServeFlags(tiers="cpu", kv_events_interval_ms=10), probe_host())
    with pytest.raises(ConfigError, match="need --kv-events"):
        resolve_settings(ServeFlags(tiers="cpu", kv_events_replay_mib=16), probe_host())
    for mib in (0, 65_537):
        with pytest.raises(ConfigError, match=r"--kv-events-replay-mib .* must be between 1 and 65536"):
            resolve_settings(ServeFlags(tiers="cpu", kv_events="tcp://*:5557", kv_events_replay_mib=mib), probe_host())
    for interval_ms in (0, 20_000, float("nan")):
        with pytest.raises(ConfigError, match=r"--kv-events-interval-ms .* must be between 1 and 10000 milliseconds"):
            resolve_settings(ServeFlags(tiers="cpu", kv_events="tcp://*:5557", kv_events_interval_ms=interval_ms),
                             probe_host())  # fmt: skip
    settings = resolve_settings(ServeFlags(tiers="cpu", kv_events="tcp://*:5557", kv_events_topic="t"), probe_host())
    assert settings.kv_events is not None and settings.kv_events.topic == "t" and settings.kv_events.interval_s == 0.05
    assert settings.kv_events.buffer_bytes == 256 << 20
    flags = ServeFlags(tiers="cpu", kv_events="tcp://*:5557", kv_events_interval_ms=20, kv_events_replay_mib=16)
    settings = resolve_settings(flags, probe_host())
    assert settings.kv_events is not None and settings.kv_events.interval_s == 0.02
    assert settings.kv_events.buffer_bytes == 16 << 20
