"""Shutdown of vLLM's OpenAI server with the connector (issue 28, item 5): SIGINT (a terminal's Ctrl-C, sent to the
server's whole process group) and SIGTERM (``kill PID``) stop it within 5 s, and nothing the embedded store
acknowledged is lost.

vLLM 0.32 stops its engine by SIGKILLing the engine core and every process below it. The embedded store used to be
the worker's child, so it was killed too, before it could commit the disk writes it had acknowledged (the disk tier
writes behind); it is now nobody's child and stops, flushed, once its engine is gone. Each case signals the server
right after the store acknowledged its prompts' chunks (while their disk writes are still being committed), measures
the exit, waits for the store to let go of the data dir, and counts the chunks on disk. The SIGTERM case's server is
the SIGINT case's restart on the same data dir: the SIGINT case's prompts must load from the store there.

Two server starts in all (30-90 s each on the 2-core machine).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.data_dir.server_record import live_server_record
from kvstore.pids import pid_alive
from tests.vllm.conftest import E2E_CHUNK_TOKENS, KVSTORE_CONNECTOR

pytestmark = pytest.mark.engine_minutes(1.6)

EXIT_BOUND_S = 5.0
"""The target: the server process gone this long after the signal (issue 28)."""
START_TIMEOUT_S = 240.0
"""A server start here takes 30-90 s; more on a loaded CI host."""
FLUSH_TIMEOUT_S = 60.0
"""How long the detached store may take to notice its engine is gone and commit its disk writes."""
PROMPT_TOKENS = 400
"""Three whole 128-token chunks and a partial one: all four are stored, the three whole ones load on a hit."""
PROMPTS_PER_CASE = 3
HIT_TOKENS = (PROMPT_TOKENS // E2E_CHUNK_TOKENS) * E2E_CHUNK_TOKENS
"""What a restarted engine loads for a stored prompt: whole blocks only, never the prompt's last token."""


@dataclass(frozen=True, slots=True)
class Case:
    """One signal's run: its exit time and the chunks the store held before and after."""

    exit_s: float
    acknowledged: int
    on_disk: int


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` with the connector and its embedded store on ``data_dir``."""

    def __init__(self, model_dir: Path, data_dir: Path, log_path: Path, vllm_env: Mapping[str, str]) -> None:
        self.port = _free_port()
        self.data_dir = data_dir
        self.log_path = log_path
        config = {
            **KVSTORE_CONNECTOR,
            "kv_connector_extra_config": {
                "kvstore.data_dir": str(data_dir),
                "kvstore.chunk_size": E2E_CHUNK_TOKENS,
                "kvstore.tiers": "cpu,disk",
                "kvstore.cpu_size": "1GiB",
            },
        }
        self.command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", "--enforce-eager",
            "--max-model-len", "2048", "--kv-transfer-config", json.dumps(config),
        ]  # fmt: skip
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.command,
                env=os.environ | dict(vllm_env),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.model = str(model_dir)

    def wait_until_up(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"the server exited with {self.process.returncode}\n{self.log_tail()}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2.0) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise AssertionError(f"the server did not answer within {START_TIMEOUT_S:.0f} s\n{self.log_tail()}")

    def complete(self, prompt: Sequence[int]) -> dict[str, Any]:
        """One non-streamed completion of a token-id prompt, one token; the response's ``kv_transfer_params``."""
        body = {"model": self.model, "prompt": list(prompt), "max_tokens": 1, "temperature": 0}
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120.0) as response:
            reply = json.load(response)
        params: dict[str, Any] = reply.get("kv_transfer_params") or {}
        return params

    def signal_and_time_exit(self, signum: int, *, group: bool) -> float:
        """Send ``signum`` (to the whole process group: what a terminal's Ctrl-C does) and time the exit."""
        started = time.monotonic()
        if group:
            os.killpg(self.process.pid, signum)
        else:
            self.process.send_signal(signum)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(EXIT_BOUND_S * 6)
        return time.monotonic() - started

    def kill(self) -> None:
        """Whatever is left of the server's process group (a failed test)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def log_tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return f"--- last {len(text)} lines of {self.log_path} ---\n" + "\n".join(text)


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[list[Server]]:
    """The servers a test started (on ``tmp_path / "kvstore-data"``): killed if the test left them running, and
    their embedded store with them."""
    started: list[Server] = []
    yield started
    for server in started:
        server.kill()
    record = live_server_record(tmp_path / "kvstore-data")
    if record is not None:
        os.kill(record.pid, signal.SIGKILL)


def kvstore_json(*args: str) -> dict[str, Any]:
    """``kvstore inspect ... --json``: the real CLI."""
    done = subprocess.run(
        [sys.executable, "-m", "kvstore.cli.main", "inspect", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def acknowledged_chunks(url: str) -> int:
    """The chunks the running store's disk tier has accepted: every save it acknowledged, those whose writes are
    still pending (the tier writes behind) included."""
    tiers = {tier["tier"]: tier for tier in kvstore_json("--url", url)["tiers"]}
    return int(tiers["disk"]["num_chunks"])


def prompts(seed: int) -> list[list[int]]:
    """Distinct token-id prompts (ids of SmolLM2's vocabulary, no special tokens)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 40_000, PROMPT_TOKENS).tolist() for _ in range(PROMPTS_PER_CASE)]


def run_case(server: Server, new_prompts: list[list[int]], signum: int, *, group: bool) -> Case:
    """Send the prompts, wait until the store acknowledged their chunks, signal the server at once, and count the
    chunks on disk once the store let go of the data dir."""
    record = live_server_record(server.data_dir)
    assert record is not None, f"no embedded store serves {server.data_dir}\n{server.log_tail()}"
    before = acknowledged_chunks(record.url)
    for prompt in new_prompts:
        server.complete(prompt)
    expected = before + sum(math.ceil(len(prompt) / E2E_CHUNK_TOKENS) for prompt in new_prompts)
    deadline = time.monotonic() + 60
    while (acknowledged := acknowledged_chunks(record.url)) < expected and time.monotonic() < deadline:
        time.sleep(0.2)
    assert acknowledged == expected, f"the store acknowledged {acknowledged} of {expected} chunks"

    exit_s = server.signal_and_time_exit(signum, group=group)
    print(f"\n{signal.Signals(signum).name}: the OpenAI server exited {exit_s:.2f} s after the signal")
    assert server.process.returncode is not None, f"still running {exit_s:.0f} s after the signal\n{server.log_tail()}"

    deadline = time.monotonic() + FLUSH_TIMEOUT_S
    while pid_alive(record.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not pid_alive(record.pid), (
        f"the embedded store (pid {record.pid}) outlived its engine by {FLUSH_TIMEOUT_S:.0f} s"
    )
    log = (server.data_dir / "embedded-server.log").read_text(errors="replace")
    assert "stopped (pending disk writes flushed)" in log.split("listening on")[-1], "the store did not stop flushed"
    on_disk = int(kvstore_json("--data-dir", str(server.data_dir))["num_chunks"])
    return Case(exit_s=exit_s, acknowledged=acknowledged, on_disk=on_disk)


@pytest.mark.timeout(2 * START_TIMEOUT_S + 4 * FLUSH_TIMEOUT_S)
def test_sigint_and_sigterm_exit_promptly_and_lose_no_acknowledged_chunk(
    vllm_model_dir: Path, vllm_env: Mapping[str, str], tmp_path: Path, servers: list[Server]
) -> None:
    data_dir = tmp_path / "kvstore-data"
    first_prompts, second_prompts = prompts(seed=1), prompts(seed=2)

    first = Server(vllm_model_dir, data_dir, tmp_path / "server-sigint.log", vllm_env)
    servers.append(first)
    first.wait_until_up()
    interrupted = run_case(first, first_prompts, signal.SIGINT, group=True)  # Ctrl-C in the server's terminal
    assert interrupted.on_disk == interrupted.acknowledged, f"acknowledged chunks lost at SIGINT: {interrupted}"

    second = Server(vllm_model_dir, data_dir, tmp_path / "server-sigterm.log", vllm_env)
    servers.append(second)
    second.wait_until_up()
    for prompt in first_prompts:  # the restart finds what the first engine stored
        loaded = second.complete(prompt).get("kvstore", {}).get("loaded_tokens")
        assert loaded == HIT_TOKENS, f"the restarted engine loaded {loaded} tokens, not {HIT_TOKENS}"
    terminated = run_case(second, second_prompts, signal.SIGTERM, group=False)  # kill PID
    assert terminated.on_disk == terminated.acknowledged, f"acknowledged chunks lost at SIGTERM: {terminated}"

    for name, case in (("SIGINT", interrupted), ("SIGTERM", terminated)):
        assert case.exit_s <= EXIT_BOUND_S, f"{name}: the server took {case.exit_s:.1f} s to exit"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
