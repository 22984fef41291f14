"""Real ``kvstore serve`` processes on loopback for the server tests."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvstore.layout import KVLayout, RopeSpec

REPO_ROOT = Path(__file__).resolve().parents[2]
CHUNK_SIZE = 16
SERVER_LAYOUT = KVLayout(model_id="test/server", num_layers=2, num_kv_heads=2, head_dim=16, rope=RopeSpec(theta=1e5))
"""256 bytes of bf16 KV a token: a 16-token chunk is 4 KiB, so tests move many chunks quickly."""

_READY = re.compile(r"listening on (tcp://\S+) \(metrics (http://\S+)\)")


@dataclass
class ServerProcess:
    """A ``kvstore serve`` child process and its addresses."""

    process: subprocess.Popen[str]
    url: str
    metrics_url: str
    data_dir: Path
    stderr_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60) -> int:
        """Send ``sig`` and wait; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout_s)

    def kill(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(30)

    def stderr(self) -> str:
        return self.stderr_path.read_text()


def serve_args(data_dir: Path, layout_file: Path | None, *extra: str) -> list[str]:
    args = [sys.executable, "-m", "kvstore.cli.main", "serve", "--port", "0", "--metrics-port", "0"]
    args += ["--data-dir", str(data_dir), "--cpu-size", "10MiB", "--disk-size", "256MiB"]
    args += ["--chunk-size", str(CHUNK_SIZE), "--workers", "2"]
    if layout_file is not None:
        args += ["--layout", str(layout_file)]
    return args + list(extra)


def start_server(data_dir: Path, *extra: str, layout: KVLayout | None = SERVER_LAYOUT) -> ServerProcess:
    """Start a server (tiers cpu,disk unless ``extra`` says otherwise) and wait until it listens."""
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    layout_file = None
    if layout is not None:
        layout_file = data_dir.parent / f"{data_dir.name}-layout.json"
        layout_file.write_text(layout.to_json())
    stderr_path = data_dir.parent / f"{data_dir.name}-stderr-{time.monotonic_ns()}.log"
    with open(stderr_path, "w") as stderr:
        process = subprocess.Popen(
            serve_args(data_dir, layout_file, *extra),
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    assert process.stdout is not None
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        match = _READY.search(line)
        if match:
            return ServerProcess(process, match.group(1), match.group(2), data_dir, stderr_path)
    process.kill()
    process.wait()
    raise AssertionError(f"server did not start: {stderr_path.read_text()[-2000:]}")


@contextlib.contextmanager
def running_server(data_dir: Path, *extra: str, layout: KVLayout | None = SERVER_LAYOUT) -> Iterator[ServerProcess]:
    server = start_server(data_dir, *extra, layout=layout)
    try:
        yield server
    finally:
        if server.process.poll() is None:
            server.stop()
        assert server.process.stdout is not None
        server.process.stdout.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server (cpu,disk tiers, blend on) shared by a test module."""
    with running_server(tmp_path_factory.mktemp("server") / "data", "--enable-blend") as started:
        yield started


def segments_mapped(server_pid: int, client_pid: int) -> int:
    """How many mappings of segments that ``client_pid`` created the server process still holds."""
    prefix = f"/memfd:kvstore-{client_pid}-"
    with open(f"/proc/{server_pid}/maps") as maps:
        return sum(1 for line in maps if prefix in line)
