"""``kvstore inspect --url`` and ``kvstore evict --url`` against a real server, and the offline commands beside it."""

from __future__ import annotations

import json

import pytest

from kvstore import Client
from kvstore.cli.main import main
from tests.factories import make_kv, make_tokens
from tests.server.conftest import CHUNK_SIZE, SERVER_LAYOUT, ServerProcess

pytestmark = pytest.mark.slow


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    captured = capsys.readouterr()
    code = exited.value.code
    return (code if isinstance(code, int) else 0), captured.out, captured.err


@pytest.fixture(scope="module")
def stored_keys(server: ServerProcess) -> list[str]:
    """Keys of a 64-token sequence stored (durably) on the module's server and looked up twice."""
    tokens = make_tokens(64, seed=101)
    with Client(server.url, SERVER_LAYOUT, name="admin-test") as client:
        client.store(tokens, make_kv(SERVER_LAYOUT, 64, seed=101), durable=True)
        client.release(client.lookup(tokens))
        plan = client.lookup(tokens)
        client.release(plan)
        return [segment.key.hex() for segment in plan.segments]


def test_inspect_url_reports_tiers_layout_clients_and_hits(
    server: ServerProcess, stored_keys: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(["inspect", "--url", server.url, "--json"], capsys)
    report = json.loads(out)
    assert code == 0 and report["chunk_size"] == CHUNK_SIZE
    assert report["layout_namespace"] == SERVER_LAYOUT.namespace.hex() and report["features"]["blend"]
    cpu, disk = report["tiers"]
    assert (cpu["tier"], disk["tier"]) == ("cpu", "disk")
    assert cpu["capacity_bytes"] > 0 and cpu["num_chunks"] >= 4 and disk["num_chunks"] >= 4
    assert cpu["lookup_hits"] >= 8 and 0 < cpu["hit_ratio"] <= 1
    top = {chunk["key"]: chunk["hits"] for chunk in report["top_chunks"]}
    assert all(top.get(key, 0) >= 2 for key in stored_keys)
    assert report["num_open_plans"] == 0 and report["catalog"]["num_entries"] >= 4
    code, out, _ = run(["inspect", "--url", server.url], capsys)
    assert code == 0 and "tiers" in out and "hit rate" in out and "clients" in out and "test/server" in out


def test_inspect_url_one_chunk(
    server: ServerProcess, stored_keys: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(["inspect", "--url", server.url, "--key", stored_keys[0], "--json"], capsys)
    assert code == 0 and json.loads(out)["tiers"] == ["cpu", "disk"]
    code, out, _ = run(["inspect", "--url", server.url, "--key", "00" * 16], capsys)
    assert code == 1 and "not cached" in out


def test_offline_commands_beside_a_live_server(
    server: ServerProcess, stored_keys: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(["evict", "--path", str(server.data_dir), "--all", "--yes"], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1, err
    assert f"held by kvstore serve (pid {server.pid})" in lines[0] and f"--url {server.url}" in lines[0]
    code, out, _ = run(["inspect", "--path", str(server.data_dir), "--json"], capsys)
    assert code == 0 and json.loads(out)["num_chunks"] >= 4, "read-only inspection works beside the server"


def test_evict_url_by_key_bytes_and_all(
    server: ServerProcess, stored_keys: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(["evict", "--url", server.url, "--key", stored_keys[0], "--json"], capsys)
    report = json.loads(out)
    assert code == 0 and report["evicted_chunk_copies"] == 2 and report["still_cached"] == []
    code, out, _ = run(["evict", "--url", server.url, "--key", stored_keys[0]], capsys)
    assert code == 1 and "not found" in out
    code, out, _ = run(["evict", "--url", server.url, "--bytes", "8KiB", "--tier", "cpu", "--json"], capsys)
    assert code == 0 and json.loads(out)["freed_bytes"]["cpu"] >= 8 * 1024
    code, out, _ = run(["evict", "--url", server.url, "--all", "--yes", "--json"], capsys)
    assert code == 0 and set(json.loads(out)["freed_bytes"]) == {"cpu", "disk"}
    with Client(server.url) as admin:
        assert all(tier.num_chunks == 0 for tier in admin.stats().tiers)
    code, _, err = run(["evict", "--url", server.url, "--all", "--yes", "--tier", "gpu"], capsys)
    assert code == 1 and "the server's tiers are cpu,disk" in err
