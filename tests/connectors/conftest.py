"""Data dirs for embedded servers, and the processes the connector tests start: nothing outlives its test."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.connectors.settings import EmbeddedServerSettings
from kvstore.data_dir.server_record import live_server_record
from tests.server.conftest import CHUNK_SIZE

EMBEDDED_SERVE_SETTINGS: dict[str, object] = {
    "tiers": "cpu,disk",
    "cpu_size": "50MiB",
    "disk_size": "256MiB",
    "chunk_size": CHUNK_SIZE,
}
"""A tiny embedded server (a cpu tier of 0.05 GiB, 16-token chunks of ``SERVER_LAYOUT``: 4 KiB each)."""


def embedded_settings(data_dir: Path, **changes: object) -> EmbeddedServerSettings:
    return EmbeddedServerSettings(data_dir=data_dir, **{**EMBEDDED_SERVE_SETTINGS, **changes})  # type: ignore[arg-type]


def process_gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie waiting for its parent to reap it counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def kill_server_of(data_dir: Path) -> None:
    """SIGKILL the ``kvstore serve`` that ``data_dir``'s serve.json names, if it is still running."""
    record = live_server_record(data_dir)
    if record is None or process_gone(record.pid):
        return
    try:
        command = Path(f"/proc/{record.pid}/cmdline").read_bytes()
    except OSError:
        return
    if b"kvstore.cli.main" in command:  # never a process that reused the pid
        os.kill(record.pid, signal.SIGKILL)


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    """A fresh data dir; whatever server holds it at the end of the test is killed."""
    path = tmp_path / "data"
    yield path
    kill_server_of(path)


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[bytes] | subprocess.Popen[str]]]:
    """Child processes a test started (parents of embedded servers, data dir holders, embedded servers): killed and
    reaped at the end of the test."""
    processes: list[subprocess.Popen[bytes] | subprocess.Popen[str]] = []
    yield processes
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait(30)
        for stream in (process.stdin, process.stdout, process.stderr):
            if stream is not None:
                stream.close()
