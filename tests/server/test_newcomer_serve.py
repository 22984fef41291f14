"""Issue 45 on a real ``kvstore serve``: what a newcomer sees when a client's layout does not fit (item 4), when
``kvstore inspect --data-dir`` meets a data dir a live server holds (item 7), and what a server that never opened
its data dir leaves in it (item 10)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore import Client
from kvstore.cli.main import main
from kvstore.errors import KVStoreError
from kvstore.presets import preset_layout
from kvstore.server.usage.documents_file import DOCUMENT_HITS_FILE
from tests.factories import make_kv, make_tokens
from tests.server.conftest import SERVER_LAYOUT, running_server


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    captured = capsys.readouterr()
    code = exited.value.code
    return (code if isinstance(code, int) else 0), captured.out, captured.err


def test_a_client_layout_refused_for_room_is_one_warning_on_the_servers_console(tmp_path: Path) -> None:
    """The server started (1 MiB is above the floor for 16-token chunks) without a layout; a client of an 8B model
    (2 MiB a chunk) is refused, and the operator reads why once, however often it retries."""
    with running_server(tmp_path / "data", "--cpu-size", "1MiB", layout=None) as server:
        for _ in range(2):
            with pytest.raises(KVStoreError, match="below one chunk"):
                Client(server.url, preset_layout("llama3.1-8b"), connect_timeout_s=10).close()
        warnings = [line for line in server.stderr().splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and "refused a client's layout meta-llama/Llama-3.1-8B" in warnings[0], warnings
    assert "below one chunk" in warnings[0]


def test_inspect_data_dir_asks_the_live_server_that_holds_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data_dir = tmp_path / "data"
    with running_server(data_dir, layout=None) as server:  # an embedded server's way: the first client decides
        code, out, err = run(["inspect", "--data-dir", str(data_dir), "--json"], capsys)
        assert code == 0 and json.loads(out)["url"] == server.url and json.loads(out)["layout"] is None
        assert err.splitlines() == [
            f"kvstore inspect: {data_dir} is held by kvstore serve (pid {server.pid}); asking it at {server.url}"
        ]
        with Client(server.url, SERVER_LAYOUT) as client:
            client.store(make_tokens(32, seed=1), make_kv(SERVER_LAYOUT, 32, seed=1), durable=True)
        code, out, _ = run(["inspect", "--data-dir", str(data_dir), "--json"], capsys)
        assert code == 0 and json.loads(out)["layout"] == SERVER_LAYOUT.describe()
        code, out, _ = run(["inspect", "--data-dir", str(data_dir), "--json", "--offline"], capsys)
        assert code == 0 and json.loads(out)["num_chunks"] == 2, "--offline reads the files beside the server"


def test_a_server_that_never_opened_its_data_dir_leaves_no_counts_in_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data_dir = tmp_path / "data"
    with running_server(data_dir, layout=None) as server:
        assert server.stop() == 0
    assert not (data_dir / DOCUMENT_HITS_FILE).exists()
    code, out, err = run(["inspect", "--data-dir", str(data_dir)], capsys)
    assert code == 1 and out == "" and "not a kvstore data dir (no data.mdb)" in err
    (data_dir / DOCUMENT_HITS_FILE).write_bytes(b"")  # what servers before issue 45 left behind
    code, out, err = run(["inspect", "--data-dir", str(data_dir)], capsys)
    lines = err.splitlines()
    assert code == 1 and out == "" and len(lines) == 1, err
    assert (
        "holds no KV yet (no data.mdb, only document-hits.msgpack)" in lines[0]
        and "no client named a layout" in lines[0]
    )
