"""The newcomer's path, in order, in one directory: the README's Python samples, then docs/vllm.md's quick start.

Run as written: the README's samples leave ``./kvstore-data`` holding SmolLM2 in bfloat16, then the quick start's
three shell blocks (the model's export, vLLM's OpenAI server with the connector, the chat example and ``kvstore
inspect``) run in the same directory, which links the checkout's ``.venv-vllm`` and ``docs`` as a checkout has them.
Only the port (a free one for 8000) changes, and ``make vllm`` is not run: this test already runs in ``.venv-vllm``.
Every step must succeed without a traceback anywhere: the samples' output, the server's log, the client's output.
The connector's embedded data dir used to be that same ``./kvstore-data``, and the engine stopped at start with 255
lines and five tracebacks over the float32/bfloat16 mismatch.

The server is stopped as a terminal's Ctrl-C stops it (SIGINT to its process group); its exit time is printed (the
figure of docs/vllm.md's "Shutdown", with ``-s``) and bounded as test_openai_shutdown.py bounds it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine_minutes(1.1)

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 300.0
"""A server start here takes 30-90 s; more on a loaded CI host."""
EXIT_BOUND_S = 5.0
"""The server gone this long after Ctrl-C (test_openai_shutdown.py's bound)."""
SAMPLES_TIMEOUT_S = 600.0
"""The README's samples (the blend sample loads SmolLM2) and the client's two requests, each."""


def _readme_samples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (REPO_ROOT / "README.md").read_text(), flags=re.DOTALL)


def _quick_start() -> list[str]:
    """docs/vllm.md's three quick-start shell blocks, in order."""
    found = re.findall(
        r"<!-- quick start, step (\d)[^>]*-->\n```bash\n(.*?)```", (REPO_ROOT / "docs/vllm.md").read_text(), re.DOTALL
    )
    assert [step for step, _ in found] == ["1", "2", "3"], "docs/vllm.md lost a quick-start block"
    return [block for _, block in found]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _no_traceback(what: str, output: str) -> None:
    assert "Traceback" not in output, f"{what} printed a traceback:\n{output[-4000:]}"


def _without_vllms_shutdown_race(shutdown_log: str) -> str:
    """The shutdown's log less one traceback vLLM logs on Ctrl-C: the API server's output handler sees the engine core
    it just stopped and logs ``AsyncLLM output_handler failed`` with an ``EngineDeadError``, every line tagged
    ``[async_llm.py:...]``. It is vLLM's race (vllm-project/vllm#48745), not the connector's: on 2026-12-07 it came in
    3 of 5 runs of this quick start without the connector and 0 of 5 with it (benchmarks/vllm_shutdown_race.sh), 3 of
    7 with it the day before; the server still exits promptly and the store flushes. Any other traceback, a connector
    thread's included, stays."""
    if "EngineDeadError" not in shutdown_log:
        return shutdown_log
    return "\n".join(line for line in shutdown_log.splitlines() if "[async_llm.py:" not in line)


def _run(what: str, command: list[str], root: Path, timeout_s: float) -> tuple[str, str]:
    """The command's stdout and stderr, once it exited 0 and printed no traceback."""
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=timeout_s)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{what} exited {done.returncode}:\n{output[-4000:]}"
    _no_traceback(what, output)
    return done.stdout, done.stderr


@contextlib.contextmanager
def _server(block: str, root: Path, model_dir: str, port: int, log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Step 2 as a terminal runs it (a session of its own, so Ctrl-C is a signal to its process group)."""
    env = os.environ | {"MODEL_DIR": model_dir}
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            ["bash", "-c", block.replace("--port 8000", f"--port {port}")],
            cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        yield process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _wait_until_up(process: subprocess.Popen[bytes], port: int, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the server exited with {process.returncode}:\n{log_path.read_text()[-4000:]}"
        with (
            contextlib.suppress(urllib.error.URLError, OSError),
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2.0) as response,
        ):
            if response.status == 200:
                return
        time.sleep(0.5)
    raise AssertionError(f"the server did not answer within {START_TIMEOUT_S:.0f} s:\n{log_path.read_text()[-4000:]}")


@pytest.mark.timeout(2 * SAMPLES_TIMEOUT_S + START_TIMEOUT_S)  # about 4 minutes on an idle 2-core machine
def test_the_readme_then_the_vllm_quick_start_in_one_directory(tmp_path: Path) -> None:
    root = tmp_path / "checkout"
    root.mkdir()
    for name in (".venv-vllm", "docs"):
        (root / name).symlink_to(REPO_ROOT / name)
    assert Path(sys.prefix).resolve() == (REPO_ROOT / ".venv-vllm").resolve(), "run it from .venv-vllm (make test-vllm)"

    samples = _readme_samples()
    assert len(samples) >= 3
    for index, sample in enumerate(samples):
        _run(f"README sample {index}", [sys.executable, "-c", sample], root, timeout_s=SAMPLES_TIMEOUT_S)
    assert (root / "kvstore-data" / "data.mdb").is_file()  # what used to stop the engine below

    setup, serve, client = _quick_start()
    assert setup.startswith("make vllm\n"), setup
    exported, _ = _run("quick start step 1", ["bash", "-c", setup.removeprefix("make vllm\n") + 'echo "$MODEL_DIR"'],
                    root, timeout_s=SAMPLES_TIMEOUT_S)  # fmt: skip
    model_dir = exported.strip().splitlines()[-1]
    assert (Path(model_dir) / "config.json").is_file(), exported

    port = _free_port()
    log_path = tmp_path / "vllm.log"
    with _server(serve, root, model_dir, port, log_path) as server:
        _wait_until_up(server, port, log_path)
        output, said = _run("quick start step 3", ["bash", "-c", client.replace("--port 8000", f"--port {port}")],
                      root, timeout_s=SAMPLES_TIMEOUT_S)  # fmt: skip
        loaded = [int(n) for n in re.findall(r'"loaded_tokens": (\d+)', output)]
        assert len(loaded) == 2 and loaded[0] == 0 and loaded[1] > 1000, output
        assert "asking it at tcp://" in said and "never_stored" in output, output + said

        before_ctrl_c = log_path.read_text(errors="replace")
        started = time.monotonic()
        os.killpg(server.pid, signal.SIGINT)  # Ctrl-C
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(EXIT_BOUND_S * 6)
        exit_s = time.monotonic() - started
    print(f"\nquick start: vLLM's OpenAI server exited {exit_s:.2f} s after Ctrl-C")
    assert server.returncode is not None and exit_s <= EXIT_BOUND_S, f"still running after {exit_s:.1f} s"
    log = log_path.read_text(errors="replace")
    _no_traceback("the server", before_ctrl_c)
    _no_traceback("the server's shutdown", _without_vllms_shutdown_race(log[len(before_ctrl_c) :]))
    (data_dir,) = (root / "kvstore-data").glob("SmolLM2-135M-Instruct-*-float32-*")
    assert f"store {data_dir.relative_to(root)}" in log
