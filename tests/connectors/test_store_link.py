"""``StoreLink``: an outage is ``None`` (never a failed request), paid once per ``retry_s`` and logged once; the
link comes back by itself, to a restarted server or, in the embedded mode, to a new one it starts."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvstore import Client, ConfigError, KVLayout, LayoutMismatchError, ServerUnavailableError
from kvstore.connectors.settings import ConnectorSettings
from kvstore.connectors.store_link import StoreLink, connect_links
from kvstore.data_dir.server_record import live_server_record
from tests.connectors.conftest import embedded_settings, process_gone
from tests.factories import make_kv, make_tokens
from tests.server.conftest import REPO_ROOT, SERVER_LAYOUT, ServerProcess, running_server, start_server
from tests.server.test_client import free_port, wait_until

pytestmark = pytest.mark.slow

TIMEOUT_S = 1.0
RETRY_S = 2.0
OTHER_LAYOUT = KVLayout(model_id="test/other", num_layers=2, num_kv_heads=2, head_dim=16)


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server the tests in this module only talk to (never stop)."""
    with running_server(tmp_path_factory.mktemp("shared") / "data") as started:
        yield started


@pytest.fixture
def link_warnings(caplog: pytest.LogCaptureFixture) -> Callable[[str], int]:
    """How many WARNING records of the link's logger hold a fragment."""
    caplog.set_level(logging.WARNING, logger="kvstore.connectors.store_link")

    def count(fragment: str) -> int:
        return sum(
            1
            for record in caplog.records
            if record.name == "kvstore.connectors.store_link"
            and record.levelno == logging.WARNING
            and fragment in record.getMessage()
        )

    return count


def url_link(url: str) -> StoreLink:
    return StoreLink(ConnectorSettings(url=url, retry_s=RETRY_S), SERVER_LAYOUT, name="test link", timeout_s=TIMEOUT_S)


def embedded_link(data_dir: Path) -> StoreLink:
    settings = ConnectorSettings(embedded=embedded_settings(data_dir), retry_s=RETRY_S)
    return StoreLink(settings, SERVER_LAYOUT, name="test link", timeout_s=TIMEOUT_S)


def round_trip(link: StoreLink, seed: int) -> int | None:
    """Store 64 tokens and read them back through the link: the tokens read back, or ``None`` (store down)."""
    tokens, kv = make_tokens(64, seed=seed), make_kv(SERVER_LAYOUT, 64, seed=seed)

    def operation(client: Client) -> int:
        client.store(tokens, kv)
        result = client.retrieve(client.lookup(tokens))
        assert torch.equal(result.kv, kv[:, :, : result.num_prefix_tokens])
        return result.num_prefix_tokens

    return link.call("round trip", operation)


def timed_stats(link: StoreLink) -> tuple[object, float]:
    started = time.monotonic()
    result = link.call("stats", lambda client: client.stats())
    return result, time.monotonic() - started


def down_calls_are_free(link: StoreLink, duration_s: float) -> None:
    """Every call for ``duration_s`` returns ``None`` at once."""
    deadline = time.monotonic() + duration_s
    while time.monotonic() < deadline:
        result, elapsed_s = timed_stats(link)
        assert result is None and elapsed_s < 0.2, f"a call while down took {elapsed_s:.2f} s"
        time.sleep(0.1)


def test_an_outage_is_none_logged_once_and_the_link_returns_to_a_restarted_server(
    tmp_path: Path, children: list[subprocess.Popen[str]], link_warnings: Callable[[str], int]
) -> None:
    port = str(free_port())
    server = start_server(tmp_path / "data", "--port", port)
    children.append(server.process)
    link = url_link(server.url)
    assert link.connect() and link.is_up and link.url == server.url
    assert round_trip(link, seed=1) == 64

    # a server that stops answering (SIGSTOP), then answers again at once: the link waits retry_s anyway
    os.kill(server.pid, signal.SIGSTOP)
    result, first_failure_s = timed_stats(link)
    os.kill(server.pid, signal.SIGCONT)
    assert result is None and not link.is_up
    assert first_failure_s < 2 * TIMEOUT_S + 1, f"the first failed call took {first_failure_s:.1f} s"
    down_calls_are_free(link, RETRY_S - 0.5)
    time.sleep(0.6)
    assert round_trip(link, seed=2) == 64 and link.is_up
    assert (link_warnings("unavailable"), link_warnings("is back")) == (1, 1)

    # a server killed, down past one retry, then restarted on the same port
    server.kill()
    assert timed_stats(link)[0] is None
    down_calls_are_free(link, RETRY_S - 0.5)
    time.sleep(0.6)
    result, retry_s = timed_stats(link)  # still down: this retry pays the connect timeout once
    assert result is None and retry_s < 2 * TIMEOUT_S + 1
    down_calls_are_free(link, 0.5)
    assert (link_warnings("unavailable"), link_warnings("is back")) == (2, 1), "one warning per outage"
    restarted = start_server(tmp_path / "data", "--port", port)
    children.append(restarted.process)
    assert restarted.url == server.url
    assert wait_until(lambda: link.call("stats", lambda client: client.stats()) is not None, timeout_s=RETRY_S + 5)
    assert link.is_up and link.url == server.url and round_trip(link, seed=3) == 64
    assert (link_warnings("unavailable"), link_warnings("is back")) == (2, 2)

    link.close()
    link.close()  # idempotent
    assert link.call("stats", lambda client: client.stats()) is None, "a closed link serves without the store"
    assert restarted.process.poll() is None, "close() leaves a shared server running"


def test_the_first_failed_call_returns_within_the_timeout(
    tmp_path: Path, children: list[subprocess.Popen[str]]
) -> None:
    server = start_server(tmp_path / "data")
    children.append(server.process)
    link = url_link(server.url)
    assert link.connect()
    server.kill()
    result, elapsed_s = timed_stats(link)
    assert result is None
    assert elapsed_s < TIMEOUT_S + 0.5, (
        f"a call to a dead server returned after {elapsed_s:.1f} s with timeout_s={TIMEOUT_S}"
    )
    link.close()


def test_a_server_of_another_layout_fails_connect_and_is_an_outage_for_calls(shared_server: ServerProcess) -> None:
    """At engine start the mismatch is fatal (one line); later (a server restarted with another model) a call must
    not raise into the engine's step."""
    link = StoreLink(ConnectorSettings(url=shared_server.url), OTHER_LAYOUT, name="other", timeout_s=5.0)
    with pytest.raises(LayoutMismatchError, match="start another server"):
        link.connect()
    assert link.call("stats", lambda client: client.stats()) is None
    link.close()


def engine_bug(client: Client) -> None:
    raise RuntimeError("an engine bug")


def test_a_store_error_in_a_call_is_an_outage_and_other_errors_raise(
    shared_server: ServerProcess, link_warnings: Callable[[str], int]
) -> None:
    link = url_link(shared_server.url)
    assert link.connect()
    with pytest.raises(RuntimeError, match="an engine bug"):
        link.call("engine", engine_bug)
    assert link.is_up, "an error that is not the store's is the caller's: it raises and changes nothing"
    assert link.call("store", lambda client: client.store(make_tokens(10), make_kv(SERVER_LAYOUT, 9))) is None
    assert not link.is_up and link_warnings("unavailable") == 1
    down_calls_are_free(link, 0.5)
    link.close()
    assert shared_server.process.poll() is None


def test_no_server_at_the_url_is_an_outage(link_warnings: Callable[[str], int]) -> None:
    link = url_link(f"tcp://127.0.0.1:{free_port()}")
    started = time.monotonic()
    assert not link.connect() and not link.is_up and time.monotonic() - started < 2 * TIMEOUT_S + 1
    down_calls_are_free(link, 0.5)
    assert link_warnings("unavailable") == 1
    link.close()


def test_a_dead_embedded_server_is_replaced_at_the_first_retry(
    data_dir: Path, link_warnings: Callable[[str], int]
) -> None:
    link = embedded_link(data_dir)
    try:
        assert link.connect()
        first = live_server_record(data_dir)
        assert first is not None and link.url == first.url
        assert round_trip(link, seed=4) == 64
        os.kill(first.pid, signal.SIGKILL)  # a crash: only the link's process can reap it
        assert link.call("stats", lambda client: client.stats()) is None
        down_calls_are_free(link, RETRY_S - 0.5)
        time.sleep(0.6)
        link.call("stats", lambda client: client.stats())  # the first retry: it must start a new server

        def replaced() -> bool:
            record = live_server_record(data_dir)
            return record is not None and record.pid != first.pid

        assert wait_until(replaced, timeout_s=40), "the first retry after retry_s did not start a new server"
        assert wait_until(lambda: round_trip(link, seed=5) == 64, timeout_s=RETRY_S + 30)
        second = live_server_record(data_dir)
        assert second is not None and link.url == second.url
        assert (link_warnings("unavailable"), link_warnings("is back")) == (1, 1)
    finally:
        link.close()
    assert wait_until(lambda: process_gone(second.pid), timeout_s=30), "close() stops the server the link started"


_STARTING_PARENT = """
import sys
from pathlib import Path
from kvstore.connectors.embedded_server import ensure_embedded_server
from tests.connectors.conftest import embedded_settings
server = ensure_embedded_server(embedded_settings(Path(sys.argv[1])), start_timeout_s=90)
print(server.pid, flush=True)
sys.stdin.read()
"""
"""Another engine process that started the server (it lives until its stdin closes)."""


def test_no_call_waits_for_a_new_embedded_server_to_start(
    data_dir: Path, children: list[subprocess.Popen[str]]
) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _STARTING_PARENT, str(data_dir)],
        cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    children.append(parent)
    assert parent.stdout is not None
    first_pid = int(parent.stdout.readline())
    link = embedded_link(data_dir)
    try:
        assert link.connect()  # found: the other process's server
        os.kill(first_pid, signal.SIGKILL)
        assert wait_until(lambda: process_gone(first_pid), timeout_s=30)
        assert link.call("stats", lambda client: client.stats()) is None
        durations_s: list[float] = []
        deadline = time.monotonic() + 40
        result = None
        while result is None and time.monotonic() < deadline:
            result, elapsed_s = timed_stats(link)
            durations_s.append(elapsed_s)
            time.sleep(0.2)
        assert result is not None, "the link never came back"
        assert max(durations_s) < TIMEOUT_S + 0.5, (
            f"a call waited {max(durations_s):.1f} s (timeout_s={TIMEOUT_S}) while the link started a new server"
        )
    finally:
        link.close()


def test_connect_raises_the_embedded_servers_refusal_and_calls_do_not(
    data_dir: Path, link_warnings: Callable[[str], int]
) -> None:
    settings = ConnectorSettings(embedded=embedded_settings(data_dir, tiers="cpu,tape"), retry_s=RETRY_S)
    link = StoreLink(settings, SERVER_LAYOUT, name="test link", timeout_s=TIMEOUT_S)
    with pytest.raises(ConfigError, match="each tier must be one of gpu, cpu, disk"):
        link.connect()
    assert link.call("stats", lambda client: client.stats()) is None
    assert link_warnings("unavailable") == 1
    link.close()


def test_close_stops_the_embedded_server_this_process_started(data_dir: Path) -> None:
    link = embedded_link(data_dir)
    assert link.connect()
    record = live_server_record(data_dir)
    assert record is not None
    visitor = embedded_link(data_dir)  # finds the running server: not its own to stop
    assert visitor.connect() and visitor.url == record.url
    visitor.close()
    assert not process_gone(record.pid) and round_trip(link, seed=6) == 64
    started = time.monotonic()
    link.close()
    assert time.monotonic() - started < 1.0, "close() waited for the server's flush (an engine's exit must not)"
    assert wait_until(lambda: process_gone(record.pid), timeout_s=30) and live_server_record(data_dir) is None
    assert "stopped (pending disk writes flushed)" in (data_dir / "embedded-server.log").read_text()
    link.close()  # idempotent
    assert link.call("stats", lambda client: client.stats()) is None
    with pytest.raises(ServerUnavailableError):
        Client(record.url, SERVER_LAYOUT, connect_timeout_s=0.5)


def test_close_stops_the_embedded_server_even_after_an_outage(data_dir: Path) -> None:
    link = embedded_link(data_dir)
    try:
        assert link.connect()
        record = live_server_record(data_dir)
        assert record is not None
        os.kill(record.pid, signal.SIGSTOP)  # a stall, not a death: the same server comes back
        try:
            assert link.call("stats", lambda client: client.stats()) is None
        finally:
            os.kill(record.pid, signal.SIGCONT)
        time.sleep(RETRY_S + 0.1)
        assert round_trip(link, seed=7) == 64 and link.url == record.url
    finally:
        link.close()
    assert wait_until(lambda: process_gone(record.pid), timeout_s=30), (
        "close() left running the embedded server this process started (it forgot it after the outage)"
    )


def test_a_killed_embedded_server_fails_a_call_at_once_whatever_the_transfer_timeout(data_dir: Path) -> None:
    """A worker's links wait up to 30 s for a transfer; a server whose process is gone must not cost that: the
    link knows its embedded server's pid, and a request to it fails as soon as it has exited."""
    settings = ConnectorSettings(embedded=embedded_settings(data_dir), retry_s=RETRY_S)
    link = StoreLink(settings, SERVER_LAYOUT, name="transfer link", timeout_s=30.0)
    try:
        assert link.connect() and round_trip(link, seed=8) == 64
        record = live_server_record(data_dir)
        assert record is not None
        os.kill(record.pid, signal.SIGKILL)
        result, elapsed_s = timed_stats(link)
        assert result is None and elapsed_s < 2.0, f"a call to a dead server took {elapsed_s:.1f} s"
    finally:
        link.close()


def test_a_link_connects_within_the_lookup_timeout_not_the_transfer_timeout() -> None:
    """Engine start tries each of a worker's links once: a store that does not answer costs the lookup timeout
    per link (2 s by default), not the 30 s transfer timeout (three links: 92 s before)."""
    settings = ConnectorSettings(url=f"tcp://127.0.0.1:{free_port()}", retry_s=RETRY_S, lookup_timeout_s=0.5)
    link = StoreLink(settings, SERVER_LAYOUT, name="transfer link", timeout_s=30.0)
    try:
        started = time.monotonic()
        assert link.connect() is False
        assert time.monotonic() - started < 2.0
    finally:
        link.close()


def test_a_lookup_gives_up_on_a_hung_store_within_the_lookup_timeout(tmp_path: Path) -> None:
    """A worker's sync load runs a lookup the engine's thread waits for: on a hung store (SIGSTOP) it must cost the
    lookup timeout, not the link's 30 s transfer timeout (issue 27), and the link is then down for ``retry_s``."""
    with running_server(tmp_path / "data") as hung:
        link = StoreLink(ConnectorSettings(url=hung.url, retry_s=RETRY_S), SERVER_LAYOUT, name="load", timeout_s=30.0)
        try:
            assert link.connect()
            hung.process.send_signal(signal.SIGSTOP)
            try:
                started = time.monotonic()
                assert link.call("load", lambda client: client.lookup(make_tokens(64), timeout_s=0.5)) is None
                assert time.monotonic() - started < 1.5, "the lookup waited out the transfer timeout"
                assert not link.is_up
                down_calls_are_free(link, 0.3)
            finally:
                hung.process.send_signal(signal.SIGCONT)
        finally:
            link.close()


def test_links_connect_together_so_a_silent_store_costs_engine_start_one_timeout() -> None:
    """A worker connects three links at start; each waited its own connect timeout in turn (92 s in issue 27)."""
    settings = ConnectorSettings(url=f"tcp://127.0.0.1:{free_port()}", retry_s=RETRY_S, lookup_timeout_s=1.0)
    started = time.monotonic()
    links, reached = connect_links(settings, SERVER_LAYOUT, ["load", "async-load", "save"], timeout_s=30.0)
    elapsed_s = time.monotonic() - started
    try:
        assert not reached and len(links) == 3 and not any(link.is_up for link in links)
        assert elapsed_s < 1.9, f"three links took {elapsed_s:.1f} s to give up: they connected one after another"
    finally:
        for link in links:
            link.close()


def test_connecting_links_to_another_layout_raises_and_closes_them(shared_server: ServerProcess) -> None:
    with pytest.raises(LayoutMismatchError) as refused:
        connect_links(ConnectorSettings(url=shared_server.url), OTHER_LAYOUT, ["load", "save"], timeout_s=5.0)
    message = str(refused.value)
    assert "\n" not in message and "point kvstore.url at a kvstore serve of this model" in message, message
    assert SERVER_LAYOUT.describe() in message and OTHER_LAYOUT.describe() in message, message
    links, reached = connect_links(ConnectorSettings(url=shared_server.url), SERVER_LAYOUT, ["load"], timeout_s=5.0)
    assert reached and round_trip(links[0], seed=11) == 64
    links[0].close()


def test_an_embedded_server_of_another_layout_names_the_setting_that_fixes_it(data_dir: Path) -> None:
    """A connector user has no ``kvstore serve`` flags: the refusal names ``kvstore.data_dir`` (and the dir)."""
    with running_server(data_dir):
        settings = ConnectorSettings(embedded=embedded_settings(data_dir))
        with pytest.raises(LayoutMismatchError) as refused:
            connect_links(settings, OTHER_LAYOUT, ["scheduler"], timeout_s=5.0)
    message = str(refused.value)
    assert "\n" not in message and "--port" not in message, message
    assert f"data dir {data_dir} holds that model: set kvstore.data_dir to another dir" in message, message


def test_a_worker_link_follows_the_embedded_server_to_its_new_port(
    data_dir: Path, link_warnings: Callable[[str], int]
) -> None:
    """The embedded server dies and a new one listens on a new port: a worker's link (it did not start the server)
    finds the new one in the data dir's ``serve.json`` (issue 27: it kept the old URL, each of three links paid 30 s,
    and the log said "store at None is back"). A call on a link that finds the old server dead returns at once (and
    starts the new server in the background); a link that was idle meanwhile reaches the new one with its first call
    (the store-killed bench: a load the scheduler planned on the new server failed on a worker link still holding the
    old one)."""
    first = start_server(data_dir)
    settings = ConnectorSettings(embedded=embedded_settings(data_dir), retry_s=RETRY_S)
    link = StoreLink(settings, SERVER_LAYOUT, name="worker link", timeout_s=30.0)
    idle = StoreLink(settings, SERVER_LAYOUT, name="idle worker link", timeout_s=30.0)
    try:
        assert link.connect() and idle.connect() and link.url == idle.url == first.url
        first.kill()
        result, elapsed_s = timed_stats(link)
        assert result is None and elapsed_s < 2.0, f"a call to the dead server took {elapsed_s:.1f} s"
        assert wait_until(lambda: live_server_record(data_dir) is not None, timeout_s=60)
        second = live_server_record(data_dir)
        assert second is not None and second.url != first.url
        assert round_trip(idle, seed=13) == 64 and idle.url == second.url, "the idle link's first call"
        assert wait_until(lambda: round_trip(link, seed=12) == 64, timeout_s=RETRY_S + 5)
        assert link.url == second.url
        assert link_warnings(f"store at {second.url} is back") == 1
    finally:
        link.close()
        idle.close()
        first.kill()
        assert first.process.stdout is not None
        first.process.stdout.close()
