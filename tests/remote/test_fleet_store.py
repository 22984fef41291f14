"""Stores on several "hosts" (data dirs) sharing one real Valkey, single node and 3-master cluster: what one host
stores another serves, by prefix and by content, bit-identical; Valkey's evictions, outages, hangs and damaged
values cost misses, never errors or waits past the timeout."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.bench.valkey_server import ValkeyServer
from kvstore.chunking import Chunking, ContentCutShape
from kvstore.config import StoreConfig
from kvstore.content_cut import content_cuts
from kvstore.keys import PrefixKey, as_token_array, prefix_keys
from kvstore.layout import KVLayout
from kvstore.misses import MissReason, tokens_by_reason
from kvstore.store import TieredStore
from kvstore.tiers.base import TierName
from kvstore.tiers.remote.directory import DirectoryRun, encode_run
from kvstore.tiers.remote.names import RemoteNames
from tests.factories import make_kv, make_tokens
from tests.harness.valkey_cluster import ValkeyCluster
from tests.remote.tls_proxy import TlsProxy, self_signed_certificate

CHUNK = 16
LAYOUT = KVLayout(model_id="test/fleet", num_layers=2, num_kv_heads=2, head_dim=16)


def host_config(root: Path, name: str, url: str, **changes: object) -> StoreConfig:
    settings: dict[str, object] = {
        "tiers": ("cpu", "disk", "remote"),
        "chunk_size": CHUNK,
        "cpu_capacity_bytes": 64 * LAYOUT.chunk_bytes(CHUNK),
        "data_dir": root / name,
        "disk_capacity_bytes": 64 << 20,
        "remote_url": url,
        "remote_timeout_ms": 200,
        "enable_blend": True,
    }
    return StoreConfig(**{**settings, **changes})  # type: ignore[arg-type]


@contextlib.contextmanager
def two_hosts(root: Path, url: str, **b_changes: object) -> Iterator[tuple[TieredStore, TieredStore]]:
    """Hosts a and b: their own data dirs, one remote (b's settings changed by ``b_changes``)."""
    with TieredStore(LAYOUT, host_config(root, "a", url)) as a, TieredStore(
        LAYOUT, host_config(root, "b", url, **b_changes)
    ) as b:
        yield a, b


@pytest.fixture(params=["single", "cluster"])
def remote_url(request: pytest.FixtureRequest) -> str:
    fixture = "valkey" if request.param == "single" else "valkey_cluster"
    server: ValkeyServer | ValkeyCluster = request.getfixturevalue(fixture)
    return server.url


@pytest.fixture
def hosts(tmp_path: Path, remote_url: str) -> Iterator[tuple[TieredStore, TieredStore]]:
    with two_hosts(tmp_path, remote_url) as pair:
        yield pair


def test_a_document_stored_on_one_host_is_served_by_another_by_prefix(
    hosts: tuple[TieredStore, TieredStore],
) -> None:
    a, b = hosts
    tokens, kv = make_tokens(5 * CHUNK + 7, seed=1), make_kv(LAYOUT, 5 * CHUNK + 7, seed=1)
    assert a.store(tokens, kv).num_new_chunks == 6
    a.flush()
    b.sync_directory()  # what a published is known to b from here on (its background reader may have read it)
    plan = b.lookup(tokens)
    assert [segment.tier for segment in plan.segments] == [TierName.REMOTE] * 6
    assert all(segment.exact for segment in plan.segments) and plan.end == len(tokens)
    result = b.retrieve(plan)
    assert torch.equal(result.kv, kv)
    again = b.lookup(tokens)  # promoted into b's own tiers
    assert all(segment.tier is TierName.CPU for segment in again.segments)
    assert torch.equal(b.retrieve(again).kv, kv)


def test_a_document_is_found_by_content_at_a_new_position_on_another_host(
    hosts: tuple[TieredStore, TieredStore],
) -> None:
    a, b = hosts
    document, kv = make_tokens(4 * CHUNK + 5, seed=2), make_kv(LAYOUT, 4 * CHUNK + 5, seed=2)
    a.store(document, kv)
    a.flush()
    b.sync_directory()
    prompt = np.concatenate([make_tokens(9, seed=3), document, make_tokens(6, seed=4)])
    plan = b.lookup(prompt)
    assert [(s.start, s.source_start, s.exact) for s in plan.segments] == [
        (9 + index * CHUNK, index * CHUNK, False) for index in range(5)
    ]
    result = b.retrieve(plan)
    for segment in result.segments:
        expected = kv[:, :, segment.source_start : segment.source_start + segment.num_tokens]
        assert torch.equal(result.kv[:, :, segment.start : segment.end], expected)


def test_content_defined_chunks_are_found_at_a_new_position_on_another_host(
    tmp_path: Path, valkey: ValkeyServer
) -> None:
    """Runs of content-defined chunks (short ones mid-run) reach another host's index at their own positions, and
    a host cutting the other way shares none of the fleet's names (its prompts are never cut into these chunks)."""
    content = {"chunking": Chunking.CONTENT}
    document = make_tokens(12 * CHUNK + 5, seed=31)
    kv = make_kv(LAYOUT, len(document), seed=31)
    with (
        TieredStore(LAYOUT, host_config(tmp_path, "a", valkey.url, **content)) as a,
        TieredStore(LAYOUT, host_config(tmp_path, "b", valkey.url, **content)) as b,
        TieredStore(LAYOUT, host_config(tmp_path, "c", valkey.url)) as fixed,
    ):
        a.store(document, kv)
        a.flush()
        b.sync_directory()
        fixed.sync_directory()
        query = np.concatenate([make_tokens(9, seed=32), document])
        moved = b.retrieve(b.lookup(query))
        shape = ContentCutShape.for_chunk_size(CHUNK)
        synced = [cut for cut in content_cuts(as_token_array(document), shape).tolist() if cut >= shape.sync_tokens]
        assert sum(segment.num_tokens for segment in moved.segments) >= len(document) - synced[0]
        for segment in moved.segments:
            assert segment.tier is TierName.REMOTE and segment.start - segment.source_start == 9
            source = slice(segment.source_start, segment.source_start + segment.num_tokens)
            assert torch.equal(moved.kv[:, :, segment.start : segment.end], kv[:, :, source])
        assert fixed.lookup(query).segments == () and fixed.lookup(document).segments == ()


def test_lookups_never_wait_for_the_remote(tmp_path: Path, valkey: ValkeyServer) -> None:
    """The directory is read in the background and a lookup's remote leg is a set probe: with Valkey hung (a round
    trip would wait the 200 ms timeout) a lookup still plans the remote chunks at once."""
    with two_hosts(tmp_path, valkey.url) as (a, b):
        tokens = make_tokens(40 * CHUNK, seed=5)
        a.store(tokens, make_kv(LAYOUT, len(tokens), seed=5))
        a.flush()
        deadline = time.monotonic() + 5
        while b.stats().tier(TierName.REMOTE).num_chunks < 40 and time.monotonic() < deadline:
            time.sleep(0.01)  # the background reader, not sync_directory
        b.release(b.lookup(make_tokens(3 * CHUNK, seed=6)))  # first-call costs (the match kernels) out of the timing
        valkey.pause()
        try:
            started = time.perf_counter()
            plan = b.lookup(tokens)
            waited = time.perf_counter() - started
        finally:
            valkey.resume()
        assert [segment.tier for segment in plan.segments] == [TierName.REMOTE] * 40
        assert waited < 0.1, f"a lookup took {waited * 1e3:.0f} ms with the remote hung"
        b.release(plan)


def test_chunk_values_share_their_slot_and_spread_over_the_cluster(
    tmp_path: Path, valkey_cluster: ValkeyCluster
) -> None:
    with TieredStore(LAYOUT, host_config(tmp_path, "a", valkey_cluster.url)) as store:
        tokens = make_tokens(60 * CHUNK, seed=6)
        store.store(tokens, make_kv(LAYOUT, len(tokens), seed=6))
        store.flush()
    names = RemoteNames.for_layout("kvstore", LAYOUT, CHUNK)
    holders = set()
    with valkey_cluster.client() as client:
        for key in prefix_keys(LAYOUT.namespace, tokens, CHUNK):
            assert client.exists(names.chunk(key))
            holders.add(client.get_node_from_key(names.chunk(key)).port)
        shard_holders = {client.get_node_from_key(shard).port for shard in names.directory_shards()}
    assert len(holders) == 3 and len(shard_holders) >= 2


def test_chunks_valkey_evicted_become_misses_and_struck_out_index_entries(tmp_path: Path) -> None:
    with ValkeyServer(tmp_path / "valkey", maxmemory_bytes=3 << 20) as server:
        a_config = host_config(tmp_path, "a", server.url)
        with TieredStore(LAYOUT, a_config) as a, TieredStore(LAYOUT, host_config(tmp_path, "b", server.url)) as b:
            documents = [make_tokens(8 * CHUNK, seed=10 + index) for index in range(160)]  # ~5 MiB of values
            for index, document in enumerate(documents):
                a.store(document, make_kv(LAYOUT, len(document), seed=10 + index))
                a.flush()
            b.sync_directory()
            first, first_kv = documents[0], make_kv(LAYOUT, len(documents[0]), seed=10)
            names = RemoteNames.for_layout("kvstore", LAYOUT, CHUNK)
            with server.client() as client:  # Valkey's LRU is sampled: most, not always all, of it is gone
                held = [bool(client.exists(names.chunk(key))) for key in prefix_keys(LAYOUT.namespace, first, CHUNK)]
            assert held.count(False) >= 4, f"the oldest document should have left a 3 MiB Valkey: {held}"
            prompt = np.concatenate([make_tokens(3, seed=99), first])
            plan = b.lookup(prompt)  # the directory still lists all of it: planned from the remote
            assert [segment.tier for segment in plan.segments] == [TierName.REMOTE] * 8
            result = b.retrieve(plan)  # the evicted chunks are misses, not errors
            assert [segment.source_start // CHUNK for segment in result.segments] == [
                index for index, is_held in enumerate(held) if is_held
            ]
            assert tokens_by_reason(result.misses) == {
                MissReason.NEVER_STORED: 3,
                MissReason.EVICTED_REMOTE: CHUNK * held.count(False),
            }
            for segment in result.segments:
                source = slice(segment.source_start, segment.source_start + segment.num_tokens)
                assert torch.equal(result.kv[:, :, segment.start : segment.end], first_kv[:, :, source])
            for _ in range(2):  # the lazy two-strike rule retires the evicted chunks' index entries
                b.release(b.lookup(prompt))
            assert b.stats().catalog.num_struck_out == held.count(False)
            final = b.lookup(prompt)
            assert [segment.tier for segment in final.segments] == [TierName.CPU] * held.count(True)
            b.release(final)
            last = documents[-1]
            assert torch.equal(b.retrieve(b.lookup(last)).kv, make_kv(LAYOUT, len(last), seed=10 + 159))


def test_an_outage_keeps_the_local_tiers_serving_and_logs_once_each_way(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with ValkeyServer(tmp_path / "valkey") as server:
        config = host_config(tmp_path, "a", server.url)
        with TieredStore(LAYOUT, config) as a, TieredStore(LAYOUT, host_config(tmp_path, "b", server.url)) as b:
            stored = make_tokens(3 * CHUNK, seed=20)
            a.store(stored, make_kv(LAYOUT, len(stored), seed=20))
            a.flush()
            b.sync_directory()
            server.kill()
            caplog.set_level(logging.INFO, logger="kvstore.tiers.remote.link")
            for index in range(5):  # stores and lookups go on locally
                tokens = make_tokens(2 * CHUNK, seed=30 + index)
                kv = make_kv(LAYOUT, len(tokens), seed=30 + index)
                assert a.store(tokens, kv).num_new_chunks == 2
                a.flush()
                assert torch.equal(a.retrieve(a.lookup(tokens)).kv, kv)
            started = time.monotonic()
            unreachable = b.retrieve(b.lookup(stored))
            assert unreachable.segments == ()  # b's remote chunks are unreachable: misses
            assert [(m.start, m.end, m.reason) for m in unreachable.misses] == [
                (0, CHUNK, MissReason.REMOTE_UNAVAILABLE),
                (CHUNK, len(stored), MissReason.BEHIND_GAP),  # not read: the prefix ended at the first chunk
            ]
            assert time.monotonic() - started < 1.0
            down = [r for r in caplog.records if "unreachable" in r.getMessage()]
            assert len(down) == 2, [r.getMessage() for r in down]  # one per host
            server.restart()
            time.sleep(1.1)  # past the retry interval: the next call probes
            tokens = make_tokens(2 * CHUNK, seed=40)
            a.store(tokens, make_kv(LAYOUT, len(tokens), seed=40))
            a.flush()
            deadline = time.monotonic() + 5  # an outage closes after a second of successes (the directory readers)
            while sum("reachable again" in r.getMessage() for r in caplog.records) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert sum("reachable again" in r.getMessage() for r in caplog.records) == 2
            assert sum("unreachable" in r.getMessage() for r in caplog.records) == 2
            b.sync_directory()
            assert torch.equal(b.retrieve(b.lookup(tokens)).kv, make_kv(LAYOUT, len(tokens), seed=40))


def test_a_hung_remote_costs_a_request_at_most_its_timeout(tmp_path: Path) -> None:
    with ValkeyServer(tmp_path / "valkey") as server, two_hosts(tmp_path, server.url, remote_timeout_ms=150) as (a, b):
        tokens = make_tokens(4 * CHUNK, seed=50)
        a.store(tokens, make_kv(LAYOUT, len(tokens), seed=50))
        a.flush()
        b.sync_directory()
        server.pause()
        try:
            started = time.monotonic()
            result = b.retrieve(b.lookup(tokens))
            waited = time.monotonic() - started
        finally:
            server.resume()
        assert result.segments == ()
        assert tokens_by_reason(result.misses) == {
            MissReason.REMOTE_UNAVAILABLE: CHUNK,
            MissReason.BEHIND_GAP: len(tokens) - CHUNK,
        }
        assert waited < 0.6, f"retrieve waited {waited:.2f} s on a hung remote (timeout 0.15 s)"


def test_a_damaged_value_is_a_counted_miss_and_is_deleted(tmp_path: Path, valkey: ValkeyServer) -> None:
    with (
        TieredStore(LAYOUT, host_config(tmp_path, "a", valkey.url)) as a,
        TieredStore(LAYOUT, host_config(tmp_path, "b", valkey.url)) as b,
    ):
        tokens = make_tokens(2 * CHUNK, seed=60)
        kv = make_kv(LAYOUT, len(tokens), seed=60)
        a.store(tokens, kv)
        a.flush()
        b.sync_directory()
        name = RemoteNames.for_layout("kvstore", LAYOUT, CHUNK).chunk(prefix_keys(LAYOUT.namespace, tokens, CHUNK)[1])
        with valkey.client() as client:
            value = bytearray(client.get(name))
            value[-10] ^= 0x20
            client.set(name, bytes(value))
        result = b.retrieve(b.lookup(tokens))
        assert [segment.start for segment in result.segments] == [0]
        assert [(m.start, m.end, m.reason) for m in result.misses] == [(CHUNK, 2 * CHUNK, MissReason.CHECKSUM)]
        assert torch.equal(result.kv, kv[:, :, :CHUNK])
        assert b.stats().tier(TierName.REMOTE).corrupt_reads == 1
        b.flush()
        with valkey.client() as client:
            assert not client.exists(name)


def test_a_wrong_password_is_an_outage_not_a_failure(tmp_path: Path) -> None:
    with ValkeyServer(tmp_path / "valkey", password="right") as server:
        url = server.url.replace(":right@", ":wrong@")
        with TieredStore(LAYOUT, host_config(tmp_path, "a", url)) as a:
            tokens = make_tokens(2 * CHUNK, seed=70)
            assert a.store(tokens, make_kv(LAYOUT, len(tokens), seed=70)).num_new_chunks == 2
            a.flush()
            assert a.stats().tier(TierName.REMOTE).puts == 0
        with TieredStore(LAYOUT, host_config(tmp_path, "b", url, remote_password="right")) as b:
            b.store(tokens, make_kv(LAYOUT, len(tokens), seed=70))
            b.flush()
            assert b.stats().tier(TierName.REMOTE).puts == 2


def test_losing_a_cluster_node_keeps_every_request_working(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with ValkeyCluster(tmp_path / "cluster", num_masters=3) as cluster, two_hosts(tmp_path, cluster.url) as (a, b):
        documents = [make_tokens(6 * CHUNK, seed=80 + index) for index in range(4)]
        for index, document in enumerate(documents[:2]):
            a.store(document, make_kv(LAYOUT, len(document), seed=80 + index))
        a.flush()
        b.sync_directory()
        cluster.nodes[1].kill()
        caplog.set_level(logging.WARNING, logger="kvstore.tiers.remote.link")
        for index, document in enumerate(documents):
            kv = make_kv(LAYOUT, len(document), seed=80 + index)
            a.store(document, kv)
            a.flush()
            assert torch.equal(a.retrieve(a.lookup(document)).kv, kv)  # local tiers serve a's own
            result = b.retrieve(b.lookup(document))  # b: remote chunks, some on the lost node: gaps at worst
            for segment in result.segments:
                span = slice(segment.start, segment.end)
                assert torch.equal(result.kv[:, :, span], kv[:, :, span])
        outages = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
        assert 1 <= len(outages) <= 4, outages  # per host: the lost master's keys, and the epoch check over all


def test_under_the_evict_policy_only_what_leaves_the_disk_reaches_the_remote(
    tmp_path: Path, valkey: ValkeyServer
) -> None:
    """Host a keeps a tiny disk: its victims go to the remote as the disk stored them, joined into runs again, and
    host b finds them there by prefix and by content; what a still holds is not in the remote."""
    chunk_bytes = LAYOUT.chunk_bytes(CHUNK)
    small = {"cpu_capacity_bytes": 4 * chunk_bytes, "disk_capacity_bytes": 24 * chunk_bytes, "remote_write": "evict"}
    with two_hosts(tmp_path, valkey.url, **small) as (b, a):  # a: the evicting host (two_hosts changes its second)
        documents = [make_tokens(4 * CHUNK + 3, seed=90 + index) for index in range(12)]
        kvs = [make_kv(LAYOUT, len(document), seed=90 + index) for index, document in enumerate(documents)]
        for document, kv in zip(documents, kvs, strict=True):
            a.store(document, kv)
            a.flush()
        names = RemoteNames.for_layout("kvstore", LAYOUT, CHUNK)
        with valkey.client() as client:
            held = [
                [bool(client.exists(names.chunk(key))) for key in prefix_keys(LAYOUT.namespace, document, CHUNK)]
                for document in documents
            ]
        assert all(held[0]) and not any(held[-1]), held  # the oldest left a's disk, the newest did not
        assert a.stats().tier(TierName.REMOTE).puts == sum(map(sum, held))
        b.sync_directory()
        first = b.retrieve(b.lookup(documents[0]))
        assert [segment.tier for segment in first.segments] == [TierName.REMOTE] * 5
        assert torch.equal(first.kv, kvs[0])
        moved = b.retrieve(b.lookup(np.concatenate([make_tokens(5, seed=98), documents[1]])))
        assert len(moved.segments) == 5  # the partial last chunk too: the run's next links survived the eviction
        for segment in moved.segments:
            source = slice(segment.source_start, segment.source_start + segment.num_tokens)
            assert torch.equal(moved.kv[:, :, segment.start : segment.end], kvs[1][:, :, source])
        assert b.lookup(documents[-1]).segments == ()


def test_garbage_in_the_directory_is_skipped_and_counted(tmp_path: Path, valkey: ValkeyServer) -> None:
    """Another writer's records in the directory's streams -- not ours, damaged, or well-sealed but impossible (a
    chunk longer than the chunk size; a short chunk mid-run is not one: separators and content-defined cuts make
    them) -- never reach the index or break the reader."""
    names = RemoteNames.for_layout("kvstore", LAYOUT, CHUNK)
    bad_lengths = DirectoryRun(
        keys=(PrefixKey(bytes(16)), PrefixKey(bytes([1] * 16))),
        source_start=0,
        fingerprint_bits=64,
        fingerprints=np.array([1, 2], dtype=np.uint64),
        verifications=np.array([3, 4], dtype=np.uint64),
        lengths=np.array([5, CHUNK + 1], dtype=np.uint16),  # a chunk longer than any this fleet cuts
    )
    with valkey.client() as client:
        shard = names.directory_shard(0)
        client.xadd(shard, {b"r": b"not a record"})
        client.xadd(shard, {b"x": b"another field"})
        client.xadd(shard, {b"r": encode_run(bad_lengths, host_id=7)})
    with two_hosts(tmp_path, valkey.url) as (a, b):
        tokens = make_tokens(3 * CHUNK, seed=110)
        kv = make_kv(LAYOUT, len(tokens), seed=110)
        a.store(tokens, kv)
        a.flush()
        b.sync_directory()
        remote = b.stats().remote
        assert remote is not None and remote.directory_bad_records == 2 and remote.directory_records == 4
        catalog = b.stats().catalog
        assert catalog is not None and catalog.num_entries == 3  # a's run only
        moved = b.retrieve(b.lookup(np.concatenate([make_tokens(2, seed=111), tokens])))
        assert len(moved.segments) == 3


def test_a_remote_restarted_empty_is_forgotten_and_filled_again(
    tmp_path: Path, valkey: ValkeyServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvstore.tiers.remote.tier")
    with two_hosts(tmp_path, valkey.url) as (a, b):
        before = make_tokens(3 * CHUNK, seed=120)
        a.store(before, make_kv(LAYOUT, len(before), seed=120))
        a.flush()
        b.sync_directory()
        keys = prefix_keys(LAYOUT.namespace, before, CHUNK)
        assert [b.contains(key) for key in keys] == [[TierName.REMOTE]] * 3
        epoch = RemoteNames.for_layout("kvstore", LAYOUT, CHUNK).epoch()
        with valkey.client() as client:  # the epoch key alone goes (as Valkey's LRU may evict it): not a reset
            value = client.get(epoch)
            assert value is not None and client.delete(epoch) == 1
            b.sync_directory()
            assert client.get(epoch) == value
        assert [_resets(host) for host in (a, b)] == [0, 0]
        valkey.restart()  # no persistence: everything is gone
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(_resets(host) for host in (a, b)):
            time.sleep(0.05)
        assert [_resets(host) for host in (a, b)] == [1, 1]
        assert sum("was reset" in record.getMessage() for record in caplog.records) == 2
        assert [b.contains(key) for key in keys] == [[]] * 3  # not planned from a remote that lost them
        after = make_tokens(3 * CHUNK, seed=121)
        kv = make_kv(LAYOUT, len(after), seed=121)
        a.store(after, kv)
        a.flush()
        b.sync_directory()
        result = b.retrieve(b.lookup(after))
        assert [segment.tier for segment in result.segments] == [TierName.REMOTE] * 3
        assert torch.equal(result.kv, kv)


def test_a_restart_is_a_reset_even_when_a_write_recreates_the_directory_first(
    tmp_path: Path, valkey: ValkeyServer
) -> None:
    """The race that hid 8 resets of 10: a host's first write after the restart recreates a directory shard
    before any host reads the epoch, and "epoch gone, directory there" reads as "only the epoch was evicted". The
    hosts are held in an outage (Valkey hung) while it restarts and a shard is written, so the write comes first."""
    with two_hosts(tmp_path, valkey.url) as (a, b):
        before = make_tokens(3 * CHUNK, seed=125)
        a.store(before, make_kv(LAYOUT, len(before), seed=125))
        a.flush()
        for host in (a, b):
            host.sync_directory()  # each has read the epoch once (its directory reader does so every 50 ms)
        keys = prefix_keys(LAYOUT.namespace, before, CHUNK)
        assert [b.contains(key) for key in keys] == [[TierName.REMOTE]] * 3
        valkey.pause()
        time.sleep(0.5)  # both hosts' epoch checks time out: they fail fast for a second
        valkey.restart()  # no persistence: empty
        names = RemoteNames.for_layout("kvstore", LAYOUT, CHUNK)
        with valkey.client() as client:
            client.xadd(names.directory_shard(0), {b"r": b"a record a host wrote first"})
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(_resets(host) for host in (a, b)):
            time.sleep(0.05)
        assert [_resets(host) for host in (a, b)] == [1, 1]
        assert [b.contains(key) for key in keys] == [[]] * 3


def _resets(host: TieredStore) -> int:
    remote = host.stats().remote
    return remote.resets if remote is not None else 0


def test_tls_with_the_url_naming_the_ca(tmp_path: Path, valkey: ValkeyServer) -> None:
    certificate, key = self_signed_certificate(tmp_path)
    proxy = TlsProxy(valkey.port, certificate, key)
    try:
        trusted = f"valkeys://127.0.0.1:{proxy.port}?ssl_ca_certs={certificate}"
        with TieredStore(LAYOUT, host_config(tmp_path, "a", trusted)) as store:
            tokens = make_tokens(2 * CHUNK, seed=130)
            store.store(tokens, make_kv(LAYOUT, len(tokens), seed=130))
            store.flush()
            assert store.stats().tier(TierName.REMOTE).puts == 2  # type: ignore[union-attr]
        names = RemoteNames.for_layout("kvstore", LAYOUT, CHUNK)
        with valkey.client() as client:
            assert all(client.exists(names.chunk(k)) for k in prefix_keys(LAYOUT.namespace, tokens, CHUNK))
        untrusted = f"valkeys://127.0.0.1:{proxy.port}"  # the system's CAs do not know this certificate
        with TieredStore(LAYOUT, host_config(tmp_path, "b", untrusted)) as store:
            assert store.store(tokens, make_kv(LAYOUT, len(tokens), seed=130)).num_new_chunks == 2  # locally
            store.flush()
            remote = store.stats().remote
            assert remote is not None and not remote.available and remote.outages == 1
    finally:
        proxy.close()
