"""``KVEventPublisher`` in process over a real ``TieredStore`` and real ZeroMQ sockets: the store opening after the
publisher (the first client's layout), the start's snapshot, replay from any batch, both snapshots, a bad request,
the counts, the replay's byte budget, a close that publishes what is queued, and an endpoint it cannot open."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

from kvstore import TieredStore
from kvstore.errors import ConfigError
from kvstore.keys import PrefixKey, as_token_array, prefix_keys
from kvstore.layout import KVLayout
from kvstore.server.kv_events.consumer import ResidencyMirror, Subscriber, free_port, join_late, request
from kvstore.server.kv_events.encoding import MEDIUMS
from kvstore.server.kv_events.options import KVEventOptions
from kvstore.server.kv_events.publisher import KVEventPublisher
from kvstore.tiers.base import ChunkRecord, TierName
from tests.factories import make_kv, make_tokens, store_config

CHUNK = 8


@pytest.fixture
def store(tmp_path: Path, small_layout: KVLayout) -> Iterator[TieredStore]:
    config = store_config(tmp_path, small_layout, CHUNK, gpu_chunks=0, cpu_chunks=6, tiers=("cpu", "disk"))
    with TieredStore(small_layout, config) as opened:
        yield opened


def truth(store: TieredStore) -> set[tuple[str, bytes]]:
    return {(MEDIUMS[tier], key) for tier, keys in store.resident_keys() for key in keys}


def test_a_publisher_follows_a_store_that_opens_after_it(store: TieredStore, small_layout: KVLayout) -> None:
    replay = f"tcp://127.0.0.1:{free_port()}"
    subscriber = Subscriber(ResidencyMirror(), replay)
    opened: list[TieredStore] = []
    options = KVEventOptions(endpoint=subscriber.endpoint, replay_endpoint=replay, topic="t", max_events=4)
    publisher = KVEventPublisher(options, lambda: opened[0] if opened else None, CHUNK)
    try:
        tokens = make_tokens(3 * CHUNK, seed=1)
        store.store(tokens, make_kv(small_layout, 3 * CHUNK, seed=1))
        store.flush()
        assert request(replay, b"snapshot") == [], "no store yet: an empty snapshot"
        opened.append(store)  # the store opens: its residency so far is published first
        deadline = time.monotonic() + 10
        while publisher.stats().events["BlockStored"] < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        for seed in range(2, 6):
            store.store(make_tokens(2 * CHUNK, seed=seed), make_kv(small_layout, 2 * CHUNK, seed=seed))
        store.evict(prefix_keys(small_layout.namespace, as_token_array(tokens), CHUNK)[:1])
        store.flush()
        subscriber.receive(quiet_s=0.5)
        assert subscriber.mirror.resident == truth(store) and subscriber.mirror.cleared == 1
        from_two = request(replay, (2).to_bytes(8, "big"))
        assert [seq for seq, _ in from_two] == list(range(2, subscriber.mirror.last_seq + 1))
        late, by_keys = ResidencyMirror(), ResidencyMirror()
        join_late(replay, late)
        join_late(replay, by_keys, with_tokens=False)
        assert late.resident == by_keys.resident == truth(store)
        assert request(replay, b"what") == [], "a request that is neither a seq nor a snapshot gets the end alone"
        stats = publisher.stats()
        assert stats.batches == subscriber.mirror.last_seq + 1 and stats.queued == 0
        assert stats.requests["snapshot"] == 3 and stats.requests["invalid"] == 1 and stats.requests["replay"] >= 3
        assert stats.events["AllBlocksCleared"] == 1 and stats.events["BlockRemoved"] >= 1
    finally:
        publisher.close()
        subscriber.close()


def records(count: int) -> list[ChunkRecord]:
    rng = np.random.default_rng(3)
    return [
        ChunkRecord(key=PrefixKey(rng.bytes(16)), source_start=0, tokens=rng.integers(0, 1000, CHUNK, dtype="<u4"))
        for _ in range(count)
    ]


def wait_until_published(publisher: KVEventPublisher, stored: int) -> None:
    deadline = time.monotonic() + 10
    while publisher.stats().events["BlockStored"] < stored and time.monotonic() < deadline:
        time.sleep(0.01)
    assert publisher.stats().events["BlockStored"] == stored


def test_the_replay_keeps_the_newest_batches_that_fit_its_bytes() -> None:
    replay = f"tcp://127.0.0.1:{free_port()}"
    options = KVEventOptions(endpoint=f"tcp://*:{free_port()}", replay_endpoint=replay, buffer_bytes=2_000,
                             interval_s=0.001)  # fmt: skip
    publisher = KVEventPublisher(options, lambda: None, CHUNK)
    try:
        for record in records(60):
            publisher.stored(TierName.CPU, record)
            time.sleep(0.003)  # a batch or so each
        wait_until_published(publisher, 60)
        kept = request(replay, (0).to_bytes(8, "big"))
        last = publisher.stats().batches - 1
        seqs = [seq for seq, _ in kept]
        assert seqs == list(range(seqs[0], last + 1)) and seqs[0] > 0, "the newest batches, the oldest dropped"
        assert sum(len(payload) for _, payload in kept) <= 2_000
    finally:
        publisher.close()


def test_a_close_publishes_every_change_still_queued_at_once() -> None:
    options = KVEventOptions(endpoint=f"tcp://*:{free_port()}", interval_s=10.0)
    publisher = KVEventPublisher(options, lambda: None, CHUNK)
    chunks = records(500)
    for record in chunks:
        publisher.stored(TierName.DISK, record)
    publisher.removed(TierName.DISK, [record.key for record in chunks[:7]])
    started = time.monotonic()
    publisher.close()
    assert time.monotonic() - started < 5, "a close does not wait out the batching interval"
    stats = publisher.stats()
    assert stats.queued == 0 and stats.events["BlockStored"] == 500 and stats.events["BlockRemoved"] == 1


def thread_cpu_s(thread_id: int | None) -> float:
    return int(Path(f"/proc/self/task/{thread_id}/schedstat").read_text().split()[0]) / 1e9


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads a thread's CPU time from Linux's /proc")
def test_an_idle_publisher_sleeps_until_a_change_comes(store: TieredStore) -> None:
    """Batches every millisecond, yet idle it spends no CPU; a change after a second of sleep leaves at once, and it
    sleeps again."""
    replay = f"tcp://127.0.0.1:{free_port()}"
    options = KVEventOptions(endpoint=f"tcp://*:{free_port()}", replay_endpoint=replay, interval_s=0.001)
    publisher = KVEventPublisher(options, lambda: store, CHUNK)
    try:
        wait_until_published(publisher, 0)
        time.sleep(0.2)  # the start's snapshot is sent
        thread_id = publisher._thread.native_id
        before = thread_cpu_s(thread_id)
        time.sleep(1.0)
        assert thread_cpu_s(thread_id) - before < 0.01, "an idle publisher polled"
        assert len(request(replay, (0).to_bytes(8, "big"))) == 1, "a request wakes it too"
        published = time.monotonic()
        publisher.stored(TierName.CPU, records(1)[0])
        wait_until_published(publisher, 1)
        assert time.monotonic() - published < 0.5
        time.sleep(0.2)
        before = thread_cpu_s(thread_id)
        time.sleep(1.0)
        assert thread_cpu_s(thread_id) - before < 0.01, "asleep again once the change is sent"
    finally:
        publisher.close()


def test_an_endpoint_it_cannot_open_is_a_one_line_config_error() -> None:
    context = zmq.Context()
    taken = context.socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(ConfigError, match=f"--kv-events: cannot open tcp://\\*:{port}"):
            KVEventPublisher(KVEventOptions(endpoint=f"tcp://*:{port}"), lambda: None, CHUNK)
    finally:
        taken.close(linger=0)
        context.term()
