"""``ensure_embedded_server``: the first caller starts a private ``kvstore serve`` on the data dir, every later one
(in this process or another) finds it; it is nobody's child (an engine's shutdown, which kills the engine's process
tree, cannot reach it) and stops, flushed, with the process that started it; a data dir held by a process that serves
nothing is waited for, then refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
import torch

from kvstore import Client, StoreConfig, TieredStore
from kvstore.cli.main import main
from kvstore.connectors.embedded_server import EmbeddedServer, ensure_embedded_server
from kvstore.data_dir.server_record import live_server_record
from kvstore.errors import ConfigError
from kvstore.tiers.base import TierName
from tests.connectors.conftest import embedded_settings, process_gone
from tests.factories import make_kv, make_tokens
from tests.server.conftest import CHUNK_SIZE, REPO_ROOT, SERVER_LAYOUT
from tests.server.test_client import wait_until
from tests.server.test_serve import one_line_error, run_serve

START_TIMEOUT_S = 90.0
"""Long enough for a child to import torch on a loaded two-core machine."""

_PARENT = """
import sys
from pathlib import Path
from kvstore.connectors.embedded_server import ensure_embedded_server
from tests.connectors.conftest import embedded_settings
server = ensure_embedded_server(embedded_settings(Path(sys.argv[1])), start_timeout_s=90)
print(server.url, server.pid, server.owned, flush=True)
sys.stdin.read()
"""
"""An engine process: finds or starts the server, prints ``url pid started``, lives until its stdin closes."""

_HOLDER = """
import sys, time
from pathlib import Path
from kvstore import StoreConfig, TieredStore
from kvstore.tiers.base import TierName
from tests.server.conftest import CHUNK_SIZE, SERVER_LAYOUT
config = StoreConfig(
    tiers=(TierName.DISK,), chunk_size=CHUNK_SIZE, data_dir=Path(sys.argv[1]), disk_capacity_bytes=1 << 26
)
with TieredStore(SERVER_LAYOUT, config):
    print("holding", flush=True)
    if sys.argv[2] == "stdin":
        sys.stdin.read()
    else:
        time.sleep(float(sys.argv[2]))
"""
"""A process that holds the data dir (its disk tier's LOCK) and serves nothing."""


def start_python(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args], cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def parent_line(parent: subprocess.Popen[str]) -> tuple[str, int, bool]:
    """``url, pid, started`` as a parent process printed them."""
    assert parent.stdout is not None
    line = parent.stdout.readline()
    assert line, f"the parent process exited with {parent.wait()}"
    url, pid, started = line.split()
    return url, int(pid), started == "True"


def parent_pid(pid: int) -> int:
    """``pid``'s parent, from procfs."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rfind(")") + 2 :].split()[1])


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` by parent pid (what psutil's ``children(recursive=True)`` finds)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = parent_pid(int(entry.name))
            except (OSError, ValueError):
                continue
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def log_text(data_dir: Path) -> str:
    return (data_dir / "embedded-server.log").read_text()


def store_and_check(url: str, tokens_seed: int) -> tuple[npt.NDArray[np.int64], torch.Tensor]:
    """Store 64 tokens through ``url`` and look them up again; returns the tokens and their KV."""
    tokens, kv = make_tokens(64, seed=tokens_seed), make_kv(SERVER_LAYOUT, 64, seed=tokens_seed)
    with Client(url, SERVER_LAYOUT, timeout_s=30) as client:
        assert client.store(tokens, kv).num_new_chunks == 4
        plan = client.lookup(tokens)
        assert plan.num_prefix_tokens == 64
        assert torch.equal(client.retrieve(plan).kv, kv)
    return tokens, kv


@pytest.mark.slow
def test_the_first_call_starts_a_server_that_later_calls_find(data_dir: Path) -> None:
    settings = embedded_settings(data_dir)
    server = ensure_embedded_server(settings, start_timeout_s=START_TIMEOUT_S)
    assert server.owned and server.started_by == os.getpid() and server.url.startswith("tcp://127.0.0.1:")
    assert parent_pid(server.pid) != os.getpid(), "the server is not this process's child (nor any descendant's)"
    assert os.getpgid(server.pid) == server.pid, "the server leads a process group of its own (no Ctrl-C reaches it)"
    assert os.getsid(server.pid) == os.getsid(0), "in the engine's session: the same autogroup for the CPU scheduler"
    store_and_check(server.url, tokens_seed=1)

    again = ensure_embedded_server(settings, start_timeout_s=START_TIMEOUT_S)
    assert again == EmbeddedServer(url=server.url, pid=server.pid) and not again.owned
    second_process = subprocess.run(
        [sys.executable, "-c", _PARENT, str(data_dir)], cwd=REPO_ROOT, stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert second_process.returncode == 0, second_process.stderr
    assert second_process.stdout.split() == [server.url, str(server.pid), "False"]
    assert again.stop() is False, "not ours to stop: a no-op"
    assert server.is_running()
    assert log_text(data_dir).count("listening on") == 1, "one server was started"

    assert server.stop(wait_s=30)
    assert not server.is_running() and "stopped (pending disk writes flushed)" in log_text(data_dir)
    assert server.stop()  # idempotent
    assert live_server_record(data_dir) is None


@pytest.mark.slow
def test_parents_that_arrive_together_share_one_server(data_dir: Path, children: list[subprocess.Popen[str]]) -> None:
    parents = [start_python(_PARENT, str(data_dir)) for _ in range(2)]
    children.extend(parents)
    lines = [parent_line(parent) for parent in parents]
    assert {(url, pid) for url, pid, _ in lines} == {lines[0][:2]}, lines
    assert sorted(started for *_, started in lines) == [False, True], "exactly one parent started the server"
    assert log_text(data_dir).count("listening on") == 1


@pytest.mark.slow
def test_the_server_stops_flushed_when_its_parents_process_tree_is_killed(
    data_dir: Path, children: list[subprocess.Popen[str]]
) -> None:
    parent = start_python(_PARENT, str(data_dir))
    children.append(parent)
    url, pid, started = parent_line(parent)
    assert started
    found = ensure_embedded_server(embedded_settings(data_dir), start_timeout_s=START_TIMEOUT_S)
    assert (found.url, found.pid, found.owned) == (url, pid, False)
    tokens, kv = store_and_check(url, tokens_seed=2)  # not durable: stopping must flush it

    tree = descendants(parent.pid)
    assert pid not in tree, "the server is in its parent's process tree, which vLLM's shutdown SIGKILLs"
    for process in (parent.pid, *tree):  # what vLLM's kill_process_tree does to an engine's processes
        os.kill(process, signal.SIGKILL)
    parent.wait(30)
    assert wait_until(lambda: process_gone(pid), timeout_s=30), "the server outlived its parent"
    log = log_text(data_dir)
    assert f"process {parent.pid} is gone: stopping" in log and "stopped (pending disk writes flushed)" in log, log
    assert "Traceback" not in log and live_server_record(data_dir) is None

    config = StoreConfig(tiers=(TierName.DISK,), chunk_size=CHUNK_SIZE, data_dir=data_dir, disk_capacity_bytes=1 << 26)
    with TieredStore(SERVER_LAYOUT, config) as store:  # a writable open: the server released the data dir too
        plan = store.lookup(tokens)
        assert plan.num_prefix_tokens == 64, "the server flushed its pending disk writes before exiting"
        assert torch.equal(store.retrieve(plan).kv, kv)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"cpu_size": "1000000GiB"}, "--cpu-size 1000000.00GiB does not fit"),
        ({"tiers": "cpu,tape"}, "--tiers 'cpu,tape': each tier must be one of gpu, cpu, disk"),
    ],
)
def test_settings_the_server_refuses_are_its_one_line_reason(
    data_dir: Path, changes: dict[str, object], fragment: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        ensure_embedded_server(embedded_settings(data_dir, **changes), start_timeout_s=START_TIMEOUT_S)
    message = str(raised.value)
    assert "\n" not in message and message.startswith("the embedded kvstore server did not start: kvstore: error:")
    assert fragment in message, message
    assert live_server_record(data_dir) is None


def dead_pid() -> int:
    """The pid of a process that has exited (and was reaped)."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(dead.stdout)


@pytest.mark.slow
def test_exit_with_a_dead_pid_fails_with_one_line(tmp_path: Path) -> None:
    pid = dead_pid()
    one_line_error(run_serve(tmp_path, "--exit-with-pid", str(pid)), f"--exit-with-pid {pid}: no such process")


def test_a_refused_exit_with_pid_leaves_the_signal_handlers_as_they_were(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["serve", "--data-dir", str(tmp_path / "data"), "--port", "0", "--exit-with-pid", str(dead_pid())]
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit) as exited:
            main(argv)
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert exited.value.code == 1 and len(lines) == 1 and "no such process" in lines[0], lines
        after = {sig: signal.getsignal(sig) for sig in before}
        assert after == before, "kvstore serve left its SIGINT/SIGTERM handlers installed after refusing to start"
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


@pytest.mark.slow
def test_a_data_dir_held_by_a_process_that_serves_nothing_is_refused_after_the_deadline(
    data_dir: Path, children: list[subprocess.Popen[str]]
) -> None:
    holder = start_python(_HOLDER, str(data_dir), "stdin")
    children.append(holder)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
    started = time.monotonic()
    with pytest.raises(ConfigError) as raised:
        ensure_embedded_server(embedded_settings(data_dir), start_timeout_s=1.0)
    waited_s = time.monotonic() - started
    message = str(raised.value)
    assert f"is held by process {holder.pid}, which serves no clients" in message and "kvstore.data_dir" in message
    assert "\n" not in message
    assert 1.0 <= waited_s < 10.0, f"waited {waited_s:.1f} s for a 1 s deadline"
    assert holder.poll() is None and live_server_record(data_dir) is None
    assert not (data_dir / "embedded-server.log").exists(), "no server was started"


@pytest.mark.slow
def test_a_holder_that_lets_go_before_the_deadline_is_waited_for(
    data_dir: Path, children: list[subprocess.Popen[str]]
) -> None:
    holder = start_python(_HOLDER, str(data_dir), "2")
    children.append(holder)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
    started = time.monotonic()
    server = ensure_embedded_server(embedded_settings(data_dir), start_timeout_s=START_TIMEOUT_S)
    assert server.owned
    assert time.monotonic() - started >= 1.5, "it waited for the holder to let go of the data dir"
    assert holder.wait(60) == 0  # it lets go when its store closes; its exit may come a little later on a busy machine
    store_and_check(server.url, tokens_seed=3)
    assert server.stop(wait_s=30)
    assert "stopped (pending disk writes flushed)" in log_text(data_dir)


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is a Linux feature")
def test_a_server_started_by_a_pinned_process_runs_on_the_cpus_it_left_free(data_dir: Path) -> None:
    """vLLM's CPU worker binds itself to its compute cores, by affinity and by OpenMP variables (which bind a child
    back when its torch loads): the server it starts must inherit neither."""
    machine = set(range(os.cpu_count() or 1))
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0})  # this thread only: the one that starts the child
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("GOMP_CPU_AFFINITY", "0")
            patch.setenv("OMP_NUM_THREADS", "1")
            server = ensure_embedded_server(embedded_settings(data_dir), start_timeout_s=START_TIMEOUT_S)
    finally:
        os.sched_setaffinity(0, before)
    assert server.owned
    store_and_check(server.url, tokens_seed=3)  # torch, and OpenMP with it, is loaded and has run by now
    assert os.sched_getaffinity(server.pid) == (machine - {0} or machine)
    environment = Path(f"/proc/{server.pid}/environ").read_bytes().split(b"\0")
    assert not [entry for entry in environment if entry.startswith((b"GOMP_CPU_AFFINITY=", b"OMP_NUM_THREADS="))]
    assert server.stop(wait_s=30)


def test_a_memory_only_server_is_found_in_its_data_dir_and_forgets_it_when_it_stops(data_dir: Path) -> None:
    """A server with no disk tier holds no data dir, but the connector still finds its embedded one there."""
    server = ensure_embedded_server(embedded_settings(data_dir, tiers="cpu"), start_timeout_s=START_TIMEOUT_S)
    assert server.owned
    record = live_server_record(data_dir)
    assert record is not None and (record.url, record.pid) == (server.url, server.pid)
    store_and_check(server.url, tokens_seed=3)
    assert server.stop(wait_s=30)
    assert live_server_record(data_dir) is None and not (data_dir / "data.mdb").exists()


def test_the_cpus_every_rank_is_bound_to_are_not_free() -> None:
    """A tensor-parallel engine's worker sees only its own binding: the ranks' CPUs come from vLLM's explicit
    ``VLLM_CPU_OMP_THREADS_BIND``, and when they take every CPU the server gets the whole machine, not the other
    rank's busy core."""
    from kvstore.connectors.embedded_server import _bound_cpus, _free_cpu_choices

    assert _bound_cpus("0|1") == {0, 1}
    assert _bound_cpus("0-3|4-7") == set(range(8))
    assert _bound_cpus("0,2|1,3") == {0, 1, 2, 3}
    assert _bound_cpus("auto") == _bound_cpus("nobind") == _bound_cpus("") == set()
    assert _bound_cpus("0-x|1") == set()
    if not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2:
        return
    machine = set(range(os.cpu_count() or 1))
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0})
    try:
        assert _free_cpu_choices("auto")[0] == machine - {0}
        assert _free_cpu_choices(_cpu_list_of(machine))[0] == machine  # every CPU bound: the whole machine
        assert _free_cpu_choices("0|1")[0] == (machine - {0, 1} or machine)
    finally:
        os.sched_setaffinity(0, before)


def _cpu_list_of(cpus: set[int]) -> str:
    return "|".join(str(cpu) for cpu in sorted(cpus))


def test_a_server_whose_command_line_is_not_laid_out_yet_counts_as_running() -> None:
    """Linux shows an empty command line while a process is inside ``execve`` (and while it exits): the first check
    after the launch must not call the server dead then (on two cores busy with TP ranks it did, and the engine failed
    its start). A process that shows another command line is not ours, and a zombie is gone whatever it shows."""
    from kvstore.connectors.embedded_server import _runs_server_started_by

    exited = subprocess.Popen([sys.executable, "-c", "pass"])  # not waited for: a zombie, whose cmdline is empty
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert wait_until(lambda: Path(f"/proc/{exited.pid}/stat").read_text().split(") ")[1].startswith("Z"), 30)
        assert Path(f"/proc/{exited.pid}/cmdline").read_bytes() == b""
        assert _runs_server_started_by(exited.pid, os.getpid())
        assert not EmbeddedServer(url="", pid=exited.pid, started_by=os.getpid()).is_running()
        assert wait_until(lambda: Path(f"/proc/{stranger.pid}/cmdline").read_bytes() != b"", 30)
        assert not _runs_server_started_by(stranger.pid, os.getpid())
    finally:
        stranger.kill()
        stranger.wait()
        exited.wait()
