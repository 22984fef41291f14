"""``RemoteLink`` against a real valkey-server that dies, hangs and comes back: bounded waits, fail-fast outages,
one log line each way even when the remote flaps."""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from kvstore.bench.valkey_server import ValkeyServer
from kvstore.remote_address import parse_remote_url
from kvstore.tiers.remote.link import RemoteLink


class _Clock:
    """A monotonic clock the test moves by hand (the link's retry interval without sleeping)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _ping(link: RemoteLink) -> bool:
    return bool(link.call(lambda client: client.ping(), default=False, what="ping"))


def test_an_outage_fails_fast_and_a_flapping_remote_logs_one_line_each_way(
    valkey: ValkeyServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvstore.tiers.remote.link")
    clock = _Clock()
    link = RemoteLink(parse_remote_url(valkey.url), timeout_s=0.5, retry_interval_s=1.0, clock=clock)
    try:
        assert _ping(link) and link.available
        valkey.kill()
        assert not _ping(link) and not link.available
        calls = link.stats.calls
        started = time.monotonic()
        assert not any(_ping(link) for _ in range(100))  # inside the retry interval: no round trip at all
        assert time.monotonic() - started < 0.05 and link.stats.skipped_calls == 100
        assert link.stats.calls == calls + 100
        valkey.restart()
        clock.now += 1.5
        assert _ping(link)  # the probe succeeds: the outage is closing, not closed
        assert not link.available
        valkey.kill()  # flaps
        assert not _ping(link)
        valkey.restart()
        clock.now += 1.5
        assert _ping(link)
        clock.now += 1.1
        assert _ping(link) and link.available  # a second of successes: closed
        messages = [record.getMessage() for record in caplog.records]
        assert sum("unreachable" in message for message in messages) == 1
        assert sum("reachable again" in message for message in messages) == 1
        assert link.stats.outages == 1
    finally:
        link.close()


def test_a_hung_remote_costs_each_call_at_most_the_timeout(valkey: ValkeyServer) -> None:
    link = RemoteLink(parse_remote_url(valkey.url), timeout_s=0.2)
    try:
        assert _ping(link)
        valkey.pause()
        try:
            started = time.monotonic()
            assert not _ping(link)
            assert time.monotonic() - started < 0.5
            started = time.monotonic()
            assert not _ping(link)  # failing fast now
            assert time.monotonic() - started < 0.05
        finally:
            valkey.resume()
    finally:
        link.close()


def test_a_refused_command_is_a_failed_call_not_an_outage(valkey: ValkeyServer) -> None:
    link = RemoteLink(parse_remote_url(valkey.url), timeout_s=1.0)
    try:
        assert not link.call(lambda client: client.execute_command("NO-SUCH-COMMAND"), default=False, what="odd")
        assert link.available and link.stats.refused_calls == 1 and link.stats.outages == 0
        assert _ping(link)
        closed = RemoteLink(parse_remote_url(valkey.url), timeout_s=1.0)
        closed.close()
        assert not _ping(closed)  # after close: the default, no error
    finally:
        link.close()


def test_a_full_valkey_is_one_clean_log_line_without_payload_bytes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Under ``noeviction`` every write is refused with OOM; the client library names the refused pipeline command
    with its arguments, binary values included. One line for the burst, printable ASCII, no value bytes."""
    caplog.set_level(logging.INFO, logger="kvstore.tiers.remote.link")
    value = b"KVR\x01" + bytes(range(256)) * 64
    with ValkeyServer(tmp_path / "full", maxmemory_bytes=2 << 20, maxmemory_policy="noeviction") as full:
        link = RemoteLink(parse_remote_url(full.url), timeout_s=1.0)
        try:
            written = itertools.count()

            def write(client: Any) -> bool:
                pipe = client.pipeline(transaction=False)
                for index in itertools.islice(written, 8):
                    pipe.set(f"kvstore:kv:test:{{{index:032x}}}".encode(), value)
                pipe.execute()
                return True

            outcomes = [link.call(write, default=False, what="put 8 chunks") for _ in range(40)]
            assert False in outcomes and link.stats.refused_calls > 1
        finally:
            link.close()
    lines = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert len(lines) == 1, lines
    assert lines[0].isascii() and lines[0].isprintable() and "OutOfMemoryError" in lines[0]
    assert "KVR" not in lines[0] and "kvstore:kv:test" not in lines[0]


def test_a_wrong_password_says_authentication_failed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvstore.tiers.remote.link")
    with ValkeyServer(tmp_path / "locked", password="right-one") as locked:
        link = RemoteLink(parse_remote_url(f"valkey://:wrong-one@{locked.host}:{locked.port}"), timeout_s=1.0)
        try:
            assert not _ping(link) and not link.available
        finally:
            link.close()
    lines = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert len(lines) == 1 and "refused authentication" in lines[0] and "KVSTORE_REMOTE_PASSWORD" in lines[0]
    assert "unreachable" not in lines[0] and "wrong-one" not in lines[0]
