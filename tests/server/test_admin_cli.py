"""``kvstore inspect --url`` and ``kvstore evict --url`` against a real server, and the offline commands beside it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore import Client
from kvstore.cli.main import main
from kvstore.cli.top_documents import NO_HITS_NOTE
from kvstore.server.usage.documents_file import DOCUMENT_HITS_FILE
from tests.cli.test_cli import EVICTION_REPORT_KEYS
from tests.factories import make_kv, make_tokens
from tests.server.conftest import CHUNK_SIZE, SERVER_LAYOUT, ServerProcess, running_server

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
    assert cpu["hits"] >= 8 and 0 < cpu["hit_ratio"] <= 1
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


def test_inspect_url_top_documents(
    server: ServerProcess, stored_keys: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(["inspect", "--url", server.url, "--json", "--top", "3"], capsys)
    assert code == 0
    documents = {row["first_key"]: row for row in json.loads(out)["top_documents"]}
    document = documents[stored_keys[0]]
    assert (document["num_chunks"], document["num_tokens"]) == (4, 64)
    assert document["hits"] >= 2 and document["tokens_served"] >= 128 and document["last_hit"] is not None
    assert document["tiers"] == {"cpu": 4, "disk": 4}
    assert document["first_tokens"] == [int(t) for t in make_tokens(64, seed=101)[:16]]
    code, out, _ = run(["inspect", "--url", server.url, "--top", "1"], capsys)
    assert code == 0 and "top documents by hits" in out and stored_keys[0] in out
    for bad in ("0", "1001", "many"):
        code, _, err = run(["inspect", "--url", server.url, "--top", bad], capsys)
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and "--top" in lines[0], err


def test_offline_inspect_shows_the_document_hits_the_server_saved(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data_dir = tmp_path / "data"
    tokens = make_tokens(48, seed=77)
    with running_server(data_dir) as started:
        with Client(started.url, SERVER_LAYOUT, name="offline-test") as client:
            client.store(tokens, make_kv(SERVER_LAYOUT, 48, seed=77), durable=True)
            for _ in range(3):
                client.release(client.lookup(tokens))
        code, out, _ = run(["inspect", "--data-dir", str(data_dir), "--json", "--offline"], capsys)
        report = json.loads(out)
        assert code == 0 and report["top_documents"] == [] and report["top_documents_note"] == NO_HITS_NOTE, (
            "nothing saved yet (a minute has not passed): said, not failed"
        )
        assert started.stop() == 0
    assert (data_dir / DOCUMENT_HITS_FILE).is_file(), "saved at shutdown"
    code, out, _ = run(["inspect", "--data-dir", str(data_dir), "--json", "--top", "5"], capsys)
    (document,) = json.loads(out)["top_documents"]
    assert code == 0 and (document["hits"], document["tokens_served"], document["num_tokens"]) == (3, 144, 48)
    assert document["tiers"] == {"disk": 3}
    code, out, _ = run(["inspect", "--data-dir", str(data_dir)], capsys)
    assert code == 0 and "top documents by hits" in out and document["first_key"] in out
    with running_server(data_dir) as restarted:
        with Client(restarted.url, SERVER_LAYOUT, name="offline-test") as client:
            client.release(client.lookup(tokens))
        code, out, _ = run(["inspect", "--url", restarted.url, "--json"], capsys)
        (live,) = json.loads(out)["top_documents"]
        assert live["hits"] == 4 and live["first_key"] == document["first_key"], "counting goes on after a restart"
        code, out, _ = run(["inspect", "--data-dir", str(data_dir), "--json", "--offline"], capsys)
        saved = json.loads(out)
        assert code == 0 and saved["top_documents"][0]["hits"] == 3, "offline: the counts as last saved"
        assert f"live: --url {restarted.url}" in saved["top_documents_note"]
    (data_dir / DOCUMENT_HITS_FILE).write_bytes(b"garbage")
    code, out, _ = run(["inspect", "--data-dir", str(data_dir)], capsys)
    assert code == 0 and "hit counts unreadable" in out


def test_offline_commands_beside_a_live_server(
    server: ServerProcess, stored_keys: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(["evict", "--data-dir", str(server.data_dir), "--all", "--yes"], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1, err
    assert f"held by kvstore serve (pid {server.pid})" in lines[0] and f"--url {server.url}" in lines[0]
    code, out, _ = run(["inspect", "--data-dir", str(server.data_dir), "--json", "--offline"], capsys)
    assert code == 0 and json.loads(out)["num_chunks"] >= 4, "read-only inspection works beside the server"


def test_evict_url_by_key_bytes_and_all(
    server: ServerProcess, stored_keys: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(["evict", "--url", server.url, "--key", stored_keys[0], "--json"], capsys)
    report = json.loads(out)
    assert code == 0 and report["evicted_chunks"] == 2 and report["still_cached"] == []
    assert set(report) == EVICTION_REPORT_KEYS and report["url"] == server.url and report["data_dir"] is None
    code, out, _ = run(["evict", "--url", server.url, "--key", stored_keys[0]], capsys)
    assert code == 1 and "not found" in out
    code, _, err = run(["evict", "--url", server.url, "--bytes", "8KiB", "--tier", "cpu"], capsys)
    assert code == 1 and "add --yes (drop chunks of the cpu tier in the server at" in err, "--bytes asks, as --all"
    code, out, _ = run(["evict", "--url", server.url, "--bytes", "8KiB", "--tier", "cpu", "--yes", "--json"], capsys)
    assert code == 0 and json.loads(out)["freed_bytes"]["cpu"] >= 8 * 1024
    code, out, _ = run(["evict", "--url", server.url, "--all", "--yes", "--json"], capsys)
    assert code == 0 and set(json.loads(out)["freed_bytes"]) == {"cpu", "disk"}
    with Client(server.url) as admin:
        assert all(tier.num_chunks == 0 for tier in admin.stats().tiers)
    code, _, err = run(["evict", "--url", server.url, "--all", "--yes", "--tier", "gpu"], capsys)
    assert code == 1 and "the server's tiers are cpu,disk" in err
