"""The embedded default: a private ``kvstore serve`` started by the first engine process that needs it.

An engine such as vLLM runs its scheduler and its workers in different processes, and both must reach one store,
so "embedded" cannot mean in-process: the first connector to arrive starts ``kvstore serve`` as a process of its own
on the data dir, and every later one (the other role, or a restarted engine) finds it through the data dir's
``serve.json``. A file lock in the data dir makes the check-then-start atomic across processes.

The server is nobody's child: a short-lived launcher (``detached_start``) starts it in a process group of its own
(in the engine's session: see there why) and exits, so it is reparented. vLLM stops an engine by SIGKILLing the
engine core and all its descendants (by parent pid, whatever their session), and a server that was the worker's
child died with it, losing the disk writes it had acknowledged but not yet committed (the disk tier writes behind).
Detached, it is told to exit with the process that started it (``--exit-with-pid``), so it stops with the engine and
survives nothing else; stopping flushes pending disk writes, so the next engine on the same data dir finds the cache
there. Nothing in the engine waits for that flush: ``EmbeddedServer.stop`` only asks by default, and an engine
starting on the data dir meanwhile waits for the data dir to be released. A server already holding the data dir (a
user's ``kvstore serve``, or a previous engine's server still flushing) is used, or waited for, never fought.

The server's output goes to ``DIR/embedded-server.log``; a server that dies during start-up is reported with the
last line it printed.

CPUs: vLLM's CPU worker binds itself to its compute cores (leaving ``VLLM_CPU_NUM_OF_RESERVED_CPU`` free) and
busy-polls them between steps, and a child inherits that twice: its CPU affinity, and OpenMP's binding variables
(``GOMP_CPU_AFFINITY=0``, ``OMP_NUM_THREADS=1``), with which the child's own OpenMP runtime binds it back to the
worker's cores when torch loads. A server bound there waits on the run queue behind the engine, on a 2-core host long
enough for a disk load to time out (measured: docs/design-notes.md#connectors-embedded-server). So the server starts
without those variables, on the CPUs the engine left free (every CPU when it left none): the launcher binds itself
to them before it starts the server, so every thread of the server inherits them. The engine's CPUs are the
starting worker's own and every rank's in ``VLLM_CPU_OMP_THREADS_BIND`` (``0|1``: rank 0 on core 0, rank 1 on core
1): a worker of a tensor-parallel engine sees only its own binding, and a server started on "the other" core would
sit behind the other rank's busy-polling thread (measured: every 4,000-token load at TP=2 on two cores timed out).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
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
_LAUNCHER = Path(__file__).with_name("detached_start.py")
_LAUNCH_TIMEOUT_S = 10.0
"""The least time the launcher gets (a bare interpreter's start-up, then a fork and exec)."""
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
        started_by: the pid of the process that started it (``None``: found running). Only that process stops it
            (a forked child holding a copy of this object must not).
    """

    url: str
    pid: int
    started_by: int | None = None

    @property
    def owned(self) -> bool:
        """Whether this process started the server (``stop`` ends it)."""
        return self.started_by == os.getpid()

    def is_running(self) -> bool:
        """Whether the server still runs (a zombie counts as gone; for our own server, a pid reused by another
        process too)."""
        if not pid_alive(self.pid):
            return False
        return self.started_by is None or _runs_server_started_by(self.pid, self.started_by)

    def stop(self, wait_s: float = 0.0) -> bool:
        """Ask a server this process started to stop (SIGTERM: it finishes requests in flight, flushes pending disk
        writes and exits), waiting up to ``wait_s`` for it to be gone. No-op when it is not ours or has exited.

        It is never killed: a kill would lose the disk writes it acknowledged, and a server still flushing after
        ``wait_s`` ends on its own (an engine starting on the data dir meanwhile waits for it).

        Returns:
            Whether the server is gone (one that is not ours is not asked: whether it has exited).
        """
        if not self.owned or not self.is_running():
            return not self.is_running()
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + wait_s
        while self.is_running():
            if time.monotonic() >= deadline:
                if wait_s > 0:
                    logger.warning(
                        "embedded kvstore server (pid %d) is still stopping after %.0f s (flushing its disk writes); "
                        "it exits on its own",
                        self.pid,
                        wait_s,
                    )
                return False
            time.sleep(_POLL_S)
        return True


def ensure_embedded_server(settings: EmbeddedServerSettings, *, start_timeout_s: float = 120.0) -> EmbeddedServer:
    """The server holding ``settings.data_dir``: the running one, else a new one started by this process.

    Raises:
        ConfigError: the data dir cannot be created, or the server refused its settings (its one-line reason).
        ServerUnavailableError: it did not start within ``start_timeout_s``.
    """
    data_dir = settings.settled_data_dir
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create the kvstore data dir {data_dir}: {exc.strerror}") from None
    deadline = time.monotonic() + start_timeout_s
    with _locked(data_dir / _LOCK_FILE, deadline):
        record = live_server_record(data_dir)
        if record is not None:
            logger.info("using the kvstore server already serving %s (pid %d, %s)", data_dir, record.pid, record.url)
            return EmbeddedServer(url=record.url, pid=record.pid)
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
    pid = _launch_detached(command, log_path, deadline)
    logger.info(
        "started an embedded kvstore server (pid %d, CPUs %s) on %s; its log: %s",
        pid,
        _cpus_of(pid),
        data_dir,
        log_path,
    )
    server = EmbeddedServer(url="", pid=pid, started_by=os.getpid())
    while time.monotonic() < deadline:
        record = live_server_record(data_dir)
        if record is not None and record.pid == pid:
            server.url = record.url
            return server
        if not server.is_running():
            raise ConfigError(f"the embedded kvstore server did not start: {_last_error(log_path)}")
        time.sleep(_POLL_S)
    server.stop()
    raise ServerUnavailableError(f"the embedded kvstore server on {data_dir} did not start in time; see {log_path}")


def _launch_detached(command: list[str], log_path: Path, deadline: float) -> int:
    """Start ``command`` through ``detached_start`` (see the module docstring); its pid.

    Raises:
        ServerUnavailableError: the launcher failed or did not report a pid.
    """
    env = {name: value for name, value in os.environ.items() if name not in _THREAD_BINDING_ENV}
    choices = ";".join(_cpu_list(cpus) for cpus in _free_cpu_choices())
    launcher = [sys.executable, "-I", "-S", str(_LAUNCHER), str(log_path), choices, *command]
    try:
        launched = subprocess.run(
            launcher,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            env=env,
            timeout=max(deadline - time.monotonic(), _LAUNCH_TIMEOUT_S),
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ServerUnavailableError(f"cannot start the embedded kvstore server: {exc}") from None
    output = launched.stdout.decode(errors="replace").strip()
    if launched.returncode != 0 or not output.isdigit():
        reason = launched.stderr.decode(errors="replace").strip().splitlines() or [f"exit {launched.returncode}"]
        raise ServerUnavailableError(f"cannot start the embedded kvstore server: {reason[-1]}")
    return int(output)


def _runs_server_started_by(pid: int, started_by: int) -> bool:
    """Whether ``pid`` is still the server ``started_by`` started (not a process that reused its pid): its command
    line names ``--exit-with-pid STARTED_BY``. Without procfs, trust the pid.

    An empty command line is trusted too: Linux shows one while a process is still inside ``execve`` (the launcher's
    ``Popen`` returns once the new image is committed, before the kernel has laid out its arguments) and while it
    exits. On a host whose cores are busy (two busy-polling TP ranks on two cores) the first check after the launch
    fell in that window, and the engine failed its start with "the embedded kvstore server did not start"."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    if not cmdline:
        return True
    argv = cmdline.split(b"\0")
    marker = [b"--exit-with-pid", str(started_by).encode()]
    return any(argv[index : index + 2] == marker for index in range(len(argv) - 1))


def _free_cpu_choices(omp_binding: str | None = None) -> list[set[int]]:
    """The CPU sets for the server, best first (see the module docstring): those the engine left free, then the whole
    machine (a cpuset may forbid the first, or the engine took every CPU); none when this process is not bound.
    ``omp_binding``: vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` (default: this process's environment)."""
    if not hasattr(os, "sched_getaffinity"):
        return []
    ours = os.sched_getaffinity(0)
    machine = set(range(os.cpu_count() or 1))
    if ours >= machine:
        return []
    binding = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "") if omp_binding is None else omp_binding
    taken = ours | _bound_cpus(binding)
    return [cpus for cpus in (machine - taken, machine) if cpus]


def _bound_cpus(binding: str) -> set[int]:
    """The CPUs an explicit ``VLLM_CPU_OMP_THREADS_BIND`` gives the ranks (``0-3|4-7``, ``0,2|1,3``); none for
    ``auto``, ``nobind`` or anything else (vLLM then binds the ranks itself, and each worker's affinity says where)."""
    cpus: set[int] = set()
    for part in binding.replace("|", ",").split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            return set()
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def _cpus_of(pid: int) -> str:
    try:
        return _cpu_list(os.sched_getaffinity(pid)) if hasattr(os, "sched_getaffinity") else "any"
    except OSError:
        return "unknown"


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
