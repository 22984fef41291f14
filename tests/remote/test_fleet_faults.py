"""Valkey faults the fleet tier must survive with the rest of the remote in use, on real servers: a directory shard
or the epoch key of the wrong type (another program's key, an operator's ``SET``), and a lost master of a 3-master
cluster."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import redis
import torch
from _pytest.logging import LogCaptureFixture
from redis.crc import key_slot

from kvstore.bench.valkey_server import ValkeyServer
from kvstore.keys import prefix_keys
from kvstore.remote_address import parse_remote_url
from kvstore.store import TieredStore
from kvstore.tiers.base import TierName
from kvstore.tiers.remote.link import RemoteLink
from kvstore.tiers.remote.names import RemoteNames
from tests.factories import make_kv, make_tokens
from tests.harness.valkey_cluster import ValkeyCluster
from tests.remote.test_fleet_store import CHUNK, LAYOUT, host_config, two_hosts

NAMES = RemoteNames.for_layout("kvstore", LAYOUT, CHUNK)


def _warnings(caplog: LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]


def test_a_directory_shard_of_the_wrong_type_is_skipped_and_the_others_read(
    tmp_path: Path, valkey: ValkeyServer, caplog: LogCaptureFixture
) -> None:
    """A shard replaced by a string failed every read of every shard (WRONGTYPE, 19 lines a second): no new
    document became visible anywhere. Now only that shard is skipped, counted, and logged once."""
    caplog.set_level(logging.WARNING, logger="kvstore")
    tokens = make_tokens(3 * CHUNK, seed=140)
    keys = prefix_keys(LAYOUT.namespace, tokens, CHUNK)
    bad_shard = NAMES.directory_shard((NAMES.shard_of(keys[0]) + 1) % NAMES.num_directory_shards)
    with valkey.client() as client:
        client.set(bad_shard, b"an operator's string")
    with two_hosts(tmp_path, valkey.url) as (a, b):
        kv = make_kv(LAYOUT, len(tokens), seed=140)
        a.store(tokens, kv)
        a.flush()
        for _ in range(5):
            b.sync_directory()
        assert [b.contains(key) for key in keys] == [[TierName.REMOTE]] * 3
        remote = b.stats().remote
        assert remote is not None and remote.directory_bad_records >= 5  # one per read that skipped the shard
        assert torch.equal(b.retrieve(b.lookup(tokens)).kv, kv)
        shard_lines = [line for line in _warnings(caplog) if bad_shard.decode() in line]
        assert len(shard_lines) in (1, 2) and all("WRONGTYPE" in line for line in shard_lines), shard_lines  # per host
        with valkey.client() as client:
            client.delete(bad_shard)
        b.sync_directory()
        assert any(bad_shard.decode() in line and "a stream again" in line for line in _warnings(caplog))


def test_an_epoch_key_of_the_wrong_type_is_logged_once_and_the_directory_still_read(
    tmp_path: Path, valkey: ValkeyServer, caplog: LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvstore")
    with valkey.client() as client:
        client.hset(NAMES.epoch(), "field", "another program's hash")
    with two_hosts(tmp_path, valkey.url) as (a, b):
        tokens = make_tokens(2 * CHUNK, seed=141)
        a.store(tokens, make_kv(LAYOUT, len(tokens), seed=141))
        a.flush()
        for _ in range(20):
            a.sync_directory()
            b.sync_directory()
        assert [b.contains(key) for key in prefix_keys(LAYOUT.namespace, tokens, CHUNK)] == [[TierName.REMOTE]] * 2
    wrong_type = [line for line in _warnings(caplog) if "WRONGTYPE" in line]
    assert len(wrong_type) == 2, _warnings(caplog)  # one per host, not one per check


def test_a_lost_cluster_master_leaves_the_other_masters_slots_in_use(tmp_path: Path, caplog: LogCaptureFixture) -> None:
    """The breaker was per link: one dead master failed every call, every slot. Now each master has its own: keys
    the live masters own still store on one host and load on another. (The cluster must not refuse commands for a
    slot without a master: ``cluster-require-full-coverage no``, as a cache cluster should run.)"""
    caplog.set_level(logging.WARNING, logger="kvstore.tiers.remote.link")
    with _cluster_with_a_lost_master(tmp_path) as (cluster, lost, lost_slots):
        # Timeouts a loaded CI machine keeps: at the default 200 ms a slow reply from a live master would open its
        # breaker too, and every put would be refused for reasons this test is not about.
        patient = {"remote_timeout_ms": 2000}
        with (
            TieredStore(LAYOUT, host_config(tmp_path, "a", cluster.url, **patient)) as a,
            TieredStore(LAYOUT, host_config(tmp_path, "b", cluster.url, **patient)) as b,
        ):
            documents = [make_tokens(4 * CHUNK, seed=150 + index) for index in range(8)]
            kvs = [make_kv(LAYOUT, len(document), seed=150 + index) for index, document in enumerate(documents)]
            for document, kv in zip(documents, kvs, strict=True):
                a.store(document, kv)
            a.flush()
            deadline = time.monotonic() + 10  # b's directory reads, each master behind its own breaker, may lag
            while not _knows_what_live_masters_hold(b, documents, lost_slots) and time.monotonic() < deadline:
                b.sync_directory()
                time.sleep(0.1)
            stored = a.stats().tier(TierName.REMOTE)
            assert stored.puts > 0 and stored.rejected_puts > 0  # the live masters took theirs, the lost one not
            served = whole = 0
            for document, kv in zip(documents, kvs, strict=True):
                keys = prefix_keys(LAYOUT.namespace, document, CHUNK)
                live = [key_slot(NAMES.chunk(key)) not in lost_slots for key in keys]
                known = [b.contains(key) == [TierName.REMOTE] for key in keys]
                assert all(live[i] for i in range(len(keys)) if known[i])  # never a key of the lost master
                leading = known.index(False) if False in known else len(keys)
                if live[0] and key_slot(NAMES.directory_shard(NAMES.shard_of(keys[0]))) not in lost_slots:
                    first_lost = live.index(False) if False in live else len(keys)
                    whole += leading == first_lost  # published on a live master: b knows every chunk a stored
                    # (not asserted per document: a loaded machine may drop a put on a live master, as it may)
                result = b.retrieve(b.lookup(document))
                assert result.num_prefix_tokens == leading * CHUNK
                for segment in result.segments:  # content matches past the prefix too: each bit-identical
                    span = slice(segment.start, segment.end)
                    assert torch.equal(result.kv[:, :, span], kv[:, :, span])
                served += leading
            assert served > 0 and whole > 0
    unreachable = [line for line in _warnings(caplog) if "unreachable" in line]
    assert unreachable and all(f":{lost.port}" in line for line in unreachable)
    assert any("other masters' stay in use" in line for line in unreachable)


def _knows_what_live_masters_hold(host: TieredStore, documents: list[npt.NDArray[np.int64]], lost: set[int]) -> bool:
    """Whether ``host`` knows, of every document published on a live master, each chunk up to the first lost one."""
    for document in documents:
        keys = prefix_keys(LAYOUT.namespace, document, CHUNK)
        live = [key_slot(NAMES.chunk(key)) not in lost for key in keys]
        if not live[0] or key_slot(NAMES.directory_shard(NAMES.shard_of(keys[0]))) in lost:
            continue
        first_lost = live.index(False) if False in live else len(keys)
        if any(host.contains(key) != [TierName.REMOTE] for key in keys[:first_lost]):
            return False
    return True


@contextlib.contextmanager
def _cluster_with_a_lost_master(tmp_path: Path) -> Iterator[tuple[ValkeyCluster, ValkeyServer, set[int]]]:
    """A 3-master cluster that serves the slots it still has (``cluster-require-full-coverage no``, as a cache
    cluster should run) with its third master killed; yields the cluster, that master and the slots it owned."""
    with ValkeyCluster(tmp_path / "cluster", num_masters=3) as cluster:
        for node in cluster.nodes:
            with node.client() as client:
                client.config_set("cluster-require-full-coverage", "no")
        lost = cluster.nodes[2]
        with cluster.nodes[0].client() as client:
            lost_slots = {slot for low, high in _slot_ranges(client, lost.port) for slot in range(low, high)}
        lost.kill()
        yield cluster, lost, lost_slots


def _slot_ranges(client: redis.Redis, port: int) -> list[tuple[int, int]]:
    """The slot ranges [low, high) the master on ``port`` owns."""
    replies = client.execute_command("CLUSTER", "SLOTS")
    return [(low, high + 1) for low, high, master, *_ in replies if int(master[1]) == port]


def test_a_cluster_master_restarted_empty_is_a_reset_though_the_epoch_lives_on_another(tmp_path: Path) -> None:
    """The epoch key sits on one master; a master that crashed and came back empty holds none of the chunks the
    hosts believe are there, and used to go unnoticed since the epoch key never changed."""
    with ValkeyCluster(tmp_path / "cluster", num_masters=3) as cluster:
        epoch_slot = key_slot(NAMES.epoch())
        with cluster.nodes[0].client() as client:
            restarted = next(
                node
                for node in cluster.nodes[1:]
                if not any(low <= epoch_slot < high for low, high in _slot_ranges(client, node.port))
            )
        with two_hosts(tmp_path, cluster.url) as (a, b):
            tokens = make_tokens(8 * CHUNK, seed=160)
            a.store(tokens, make_kv(LAYOUT, len(tokens), seed=160))  # a keeps them locally; b has only the remote
            a.flush()
            b.sync_directory()
            keys = prefix_keys(LAYOUT.namespace, tokens, CHUNK)
            assert [b.contains(key) for key in keys] == [[TierName.REMOTE]] * len(keys)
            restarted.restart()  # no persistence: its slots come back empty (nodes.conf keeps them its own)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not all(_resets(host) for host in (a, b)):
                a.sync_directory()
                b.sync_directory()
                time.sleep(0.1)
            assert [_resets(host) for host in (a, b)] == [1, 1]
            # b re-reads the directory: the live masters' shards name chunks the restarted one lost, so some come
            # back believed remote; what is fetched is still a's KV, what is gone a miss
            kv = make_kv(LAYOUT, len(tokens), seed=160)
            result = b.retrieve(b.lookup(tokens))
            for segment in result.segments:
                assert torch.equal(result.kv[:, :, segment.start : segment.end], kv[:, :, segment.start : segment.end])


def _resets(host: TieredStore) -> int:
    remote = host.stats().remote
    return remote.resets if remote is not None else 0


def test_a_links_first_call_on_a_cluster_with_a_dead_master_still_reaches_the_live_ones(tmp_path: Path) -> None:
    """A link not yet connected ran its first keyed call as one pipeline over the whole cluster, so one dead master
    failed every key of it (seen as 0 puts when a loaded machine's writer sent all its chunks in one first batch).
    It now connects first and splits by master like every later call."""
    with _cluster_with_a_lost_master(tmp_path) as (cluster, _lost, lost_slots):
        link = RemoteLink(parse_remote_url(cluster.url), timeout_s=2.0)
        try:
            names = [f"first-call-{index}".encode() for index in range(64)]

            def set_some(client: Any, picked: list[int]) -> list[bool]:
                pipe = client.pipeline(transaction=False)
                for index in picked:
                    pipe.set(names[index], b"v")
                pipe.execute()
                return [True] * len(picked)

            answers = link.call_keyed(names, set_some, default=False, what="first write")
        finally:
            link.close()
        live = [key_slot(name) not in lost_slots for name in names]
        assert any(live) and not all(live)
        assert answers == live  # every live master's key written, none of the dead one's
