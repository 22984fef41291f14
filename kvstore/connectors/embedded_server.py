"""The embedded default: a private ``kvstore serve`` started by the first engine process that needs it.

An engine such as vLLM runs its scheduler and its workers in different processes, and both must reach one store,
so "embedded" cannot mean in-process: the first connector to arrive starts ``kvstore serve`` as a child process on
the data dir, and every later one (the other role, or a restarted engine) finds it through the data dir's
``serve.json``. A file lock in the data dir makes the check-then-start atomic across processes.

The child is told to exit with the process that started it (``--exit-with-pid``), so the server stops with the
engine and survives nothing else; stopping flushes pending disk writes, so the next engine on the same data dir
finds the cache there. A server already holding the data dir (a user's ``kvstore serve``, or a previous engine's
server still flushing) is used, or waited for, never fought.

The child's output goes to ``DIR/embedded-server.log``; a child that dies during start-up is reported with the
last line it printed.

CPUs: vLLM's CPU worker binds itself to its compute cores (leaving ``VLLM_CPU_NUM_OF_RESERVED_CPU`` free) and
busy-polls them between steps, and a child inherits that twice: its CPU affinity, and OpenMP's binding variables
(``GOMP_CPU_AFFINITY=0``, ``OMP_NUM_THREADS=1``), with which the child's own OpenMP runtime binds it back to the
worker's cores when torch loads. A server bound there waits on the run queue behind the engine, on a 2-core host long
enough for a disk load to time out (measured: docs/design-notes.md#connectors-embedded-server). So the server starts
without those variables, moved to the CPUs the starting process left free (every CPU when it left none).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvstore.connectors.settings import EmbeddedServerSettings
from kvstore.data_dir.owner_lock import wait_until_unheld
from kvstore.data_dir.server_record import live_server_record
from kvstore.errors import ConfigError, ServerUnavailableError
from kvstore.pids import pid_alive

__all__ = ["EmbeddedServer", "ensure_embedded_server"]

logger = logging.getLogger(__name__)

_LOCK_FILE = "embedded-server.lock"
_LOG_FILE = "embedded-server.log"
_POLL_S = 0.05
_THREAD_BINDING_ENV = frozenset(
    {"GOMP_CPU_AFFINITY", "OMP_PROC_BIND", "OMP_PLACES", "KMP_AFFINITY", "OMP_NUM_THREADS", "MKL_NUM_THREADS"}
)
"""OpenMP settings an engine's worker makes for its own cores (vLLM's CPU worker sets the first and the fifth);
the server, a process of its own, runs with its defaults."""


@dataclass(slots=True, kw_only=True)
class EmbeddedServer:
    """A server found or started for a data dir.

    Args:
        url: where it listens.
        pid: its process id.
        process: the child process when this process started it (``stop`` ends it), else ``None``.
    """

    url: str
    pid: int
    process: subprocess.Popen[bytes] | None

    def is_running(self) -> bool:
        """Whether the server still runs (our child: not exited, and reaped if it has; another's: its pid lives)."""
        if self.process is not None:
            return self.process.poll() is None
        return pid_alive(self.pid)

    def stop(self, timeout_s: float = 30.0) -> None:
        """End a server this process started (SIGTERM: it flushes and exits). Idempotent; no-op when not ours."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning(
                "embedded kvstore server (pid %d) did not stop within %.0f s: killing it", self.pid, timeout_s
            )
            self.process.kill()
            self.process.wait()


def ensure_embedded_server(settings: EmbeddedServerSettings, *, start_timeout_s: float = 120.0) -> EmbeddedServer:
    """The server holding ``settings.data_dir``: the running one, else a new child of this process.

    Raises:
        ConfigError: the data dir cannot be created, or the server refused its settings (its one-line reason).
        ServerUnavailableError: it did not start within ``start_timeout_s``.
    """
    data_dir = Path(settings.data_dir)
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create the kvstore data dir {data_dir}: {exc.strerror}") from None
    deadline = time.monotonic() + start_timeout_s
    with _locked(data_dir / _LOCK_FILE, deadline):
        record = live_server_record(data_dir)
        if record is not None:
            logger.info("using the kvstore server already serving %s (pid %d, %s)", data_dir, record.pid, record.url)
            return EmbeddedServer(url=record.url, pid=record.pid, process=None)
        _wait_until_released(data_dir, deadline)
        return _start(settings, data_dir, deadline)


def _wait_until_released(data_dir: Path, deadline: float) -> None:
    """Wait while another process holds the data dir without serving it (a server flushing on its way out has
    already removed ``serve.json``)."""
    holder = wait_until_unheld(data_dir, deadline, _POLL_S)
    if holder is not None:
        raise ConfigError(
            f"the kvstore data dir {data_dir} is held by process {holder}, which serves no clients; "
            "stop it or set kvstore.data_dir to another dir"
        )


@contextlib.contextmanager
def _locked(path: Path, deadline: float) -> Iterator[None]:
    """Hold ``path`` exclusively (another process checking or starting a server holds it meanwhile)."""
    with open(path, "a+b") as handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() >= deadline:
                    raise ServerUnavailableError(
                        f"another process has been starting the kvstore server on {path.parent} for too long"
                    ) from None
                time.sleep(_POLL_S)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _start(settings: EmbeddedServerSettings, data_dir: Path, deadline: float) -> EmbeddedServer:
    command = [
        sys.executable,
        "-m",
        "kvstore.cli.main",
        "--log-level",
        "info",
        "serve",
        *settings.serve_flags(),
        "--port",
        "0",
        "--metrics-port",
        "0",
        "--exit-with-pid",
        str(os.getpid()),
    ]
    log_path = data_dir / _LOG_FILE
    env = {name: value for name, value in os.environ.items() if name not in _THREAD_BINDING_ENV}
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, start_new_session=True
        )
    _unpin(process.pid)  # right after exec, long before its interpreter starts a thread
    logger.info("started an embedded kvstore server (pid %d) on %s; its log: %s", process.pid, data_dir, log_path)
    while time.monotonic() < deadline:
        record = live_server_record(data_dir)
        if record is not None and record.pid == process.pid:
            return EmbeddedServer(url=record.url, pid=process.pid, process=process)
        if process.poll() is not None:
            raise ConfigError(f"the embedded kvstore server did not start: {_last_error(log_path)}")
        time.sleep(_POLL_S)
    process.kill()
    process.wait()
    raise ServerUnavailableError(f"the embedded kvstore server on {data_dir} did not start in time; see {log_path}")


def _unpin(pid: int) -> None:
    """Move a child off the CPUs this process is bound to (see the module docstring); no-op when it is unbound."""
    if not hasattr(os, "sched_setaffinity"):
        return
    ours = os.sched_getaffinity(0)
    machine = set(range(os.cpu_count() or 1))
    if ours >= machine:
        return
    for cpus in (machine - ours, machine):  # a cpuset may forbid the first choice
        try:
            os.sched_setaffinity(pid, cpus)
        except OSError:
            continue
        logger.info(
            "embedded kvstore server (pid %d) runs on CPUs %s (this process is bound to %s)",
            pid,
            _cpu_list(os.sched_getaffinity(pid)),
            _cpu_list(ours),
        )
        return


def _cpu_list(cpus: set[int]) -> str:
    return ",".join(str(cpu) for cpu in sorted(cpus))


def _last_error(log_path: Path) -> str:
    """The last ``kvstore: error`` line of the child's log (the CLI's one-line failure), else its last line."""
    try:
        lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return f"(its log {log_path} is unreadable)"
    errors = [line for line in lines if line.startswith("kvstore: ")]
    return (errors or lines or ["(it printed nothing)"])[-1]
