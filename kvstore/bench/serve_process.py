"""A ``kvstore serve`` child process for benchmarks that measure the store through real servers.

Started with ``--port 0 --metrics-port 0`` and the benchmark's own flags; ready once it prints its listening line.
The server's stderr goes to a file beside its data, for a benchmark that must show why a host failed.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import ConfigError
from kvstore.layout import KVLayout

__all__ = ["ServeProcess", "start_serve_process"]

_READY = re.compile(r"listening on (tcp://\S+) \(metrics (\S+)\)")
_START_TIMEOUT_S = 120


@dataclass(slots=True)
class ServeProcess:
    """A running ``kvstore serve``, its ZeroMQ address and the URL of its ``/metrics``."""

    process: subprocess.Popen[str]
    url: str
    metrics_url: str
    stderr_path: Path

    def cpu_s(self) -> float:
        """CPU seconds every live thread of the server has run (``schedstat``: nanoseconds, not ``stat``'s 10 ms
        ticks; a thread that ended took its time with it)."""
        total_ns = 0
        for stat in Path(f"/proc/{self.process.pid}/task").glob("*/schedstat"):
            try:
                total_ns += int(stat.read_text().split()[0])
            except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
                continue
        return total_ns / 1e9

    def kv_events_cpu_s(self) -> float:
        """CPU seconds of the server's KV event publisher thread (``kvstore_kv_events_cpu_seconds_total`` on its
        ``/metrics``)."""
        sample = "kvstore_kv_events_cpu_seconds_total "
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            for line in response.read().decode().splitlines():
                if line.startswith(sample):
                    return float(line.split()[1])
        raise ConfigError(f"{self.metrics_url} exports no {sample.strip()}: is the server publishing KV events?")

    def stop(self) -> None:
        """SIGTERM (the server flushes), SIGKILL after a minute."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


def start_serve_process(
    layout: KVLayout, chunk_size: int, directory: Path, flags: Sequence[str], *, name: str = "server"
) -> ServeProcess:
    """Start ``kvstore serve --layout ... --chunk-size ... FLAGS`` and wait until it listens.

    Args:
        layout: written to ``directory/<name>-layout.json`` and passed as ``--layout``.
        chunk_size: ``--chunk-size``.
        directory: where the layout file and the stderr log go (flags name any data dir).
        flags: the rest of the command line (tiers, sizes, data dir, ...).
        name: file-name prefix, for several servers in one directory.

    Raises:
        ConfigError: it exited or did not listen within two minutes (its stderr tail is in the message).
    """
    layout_file = directory / f"{name}-layout.json"
    layout_file.write_text(layout.to_json())
    stderr_path = directory / f"{name}-stderr.log"
    command = [
        sys.executable, "-m", "kvstore.cli.main", "serve", "--port", "0", "--metrics-port", "0",
        "--chunk-size", str(chunk_size), "--layout", str(layout_file), *flags,
    ]  # fmt: skip
    with open(stderr_path, "w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True)
    assert process.stdout is not None
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        if match := _READY.search(line):
            url, metrics_url = match.groups()
            return ServeProcess(process=process, url=url, metrics_url=metrics_url, stderr_path=stderr_path)
    process.kill()
    process.wait()
    tail = stderr_path.read_text()[-400:].strip().splitlines()
    raise ConfigError(f"the benchmark's kvstore serve ({name}) did not start: {tail[-1] if tail else 'no output'}")
