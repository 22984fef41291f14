"""``kvstore`` starts without importing its commands: ``--version`` and ``--help`` are fast, and a Ctrl-C while a
command's modules load is one line and exit 130 (issue 27: 6.5 s and a 28-48-line traceback before)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore.cli.bench import bench_app
from kvstore.cli.main import app
from tests.cli.test_cli import run

REPO_ROOT = Path(__file__).resolve().parents[2]
_COMMAND_MODULES = ("kvstore.cli.serve", "kvstore.cli.inspect", "kvstore.cli.bench", "kvstore.cli.demo")


def _modules_after(argv: list[str]) -> tuple[int, set[str]]:
    """Run ``kvstore ARGV`` in a fresh interpreter; its exit code and the modules it had loaded when it exited."""
    probe = (
        "import atexit, json, sys\n"
        "atexit.register(lambda: sys.__stderr__.write('MODULES ' + json.dumps(sorted(sys.modules)) + '\\n'))\n"
        "from kvstore.cli.main import main\n"
        f"main({argv!r})\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120, check=False
    )
    line = next(line for line in completed.stderr.splitlines() if line.startswith("MODULES "))
    return completed.returncode, set(json.loads(line.removeprefix("MODULES ")))


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["serve", "--help"]])
def test_version_and_help_import_neither_torch_nor_numba_nor_any_other_command(argv: list[str]) -> None:
    code, modules = _modules_after(argv)
    assert code == 0
    assert not {"torch", "numba", "lmdb", "zmq", "kvstore.store", "kvstore.server.app"} & modules
    assert {module for module in _COMMAND_MODULES if module in modules} <= {f"kvstore.cli.{argv[0]}"}


def test_version_takes_well_under_a_second() -> None:
    """Wall time of the whole process, interpreter start included (the best of three: the machine is shared)."""
    timings = []
    for _ in range(3):
        started = time.perf_counter()
        completed = subprocess.run(
            [sys.executable, "-m", "kvstore.cli.main", "--version"], capture_output=True, text=True, cwd=REPO_ROOT
        )
        timings.append(time.perf_counter() - started)
        assert completed.returncode == 0 and completed.stdout.startswith("kvstore ")
    assert min(timings) < 1.0, timings


@pytest.mark.parametrize(
    "argv", [["serve", "--port", "0", "--metrics-port", "0"], ["inspect"]], ids=["serve", "inspect"]
)
def test_ctrl_c_while_a_command_loads_is_one_line_and_exit_130(argv: list[str], tmp_path: Path) -> None:
    """SIGINT lands while torch is being imported (``-X importtime`` tells when: its first modules are done)."""
    data_dir = tmp_path / "d"
    if argv[0] == "inspect":  # a dir without data.mdb is refused before torch is imported (issue 45): give it one
        data_dir.mkdir()
        (data_dir / "data.mdb").write_bytes(b"")
    command = [sys.executable, "-X", "importtime", "-m", "kvstore.cli.main", *argv, "--data-dir", str(data_dir)]
    with subprocess.Popen(
        command,
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        # Ctrl-C as a terminal delivers it: a test run started in the background of a non-interactive shell
        # (`make test &`) ignores SIGINT, and a child would inherit that and never see the signal.
        preexec_fn=_default_sigint,
    ) as process:
        assert process.stderr is not None and process.stdout is not None
        for line in process.stderr:
            if line.split("|")[-1].strip() == "torch._utils":  # torch's import has begun; it takes seconds more
                process.send_signal(signal.SIGINT)
                break
        else:
            pytest.fail("torch was never imported")
        rest = [line for line in process.stderr.read().splitlines() if not line.startswith("import time:")]
        assert process.wait(60) == 130
        assert rest == ["kvstore: interrupted"] and process.stdout.read() == ""
    written = sorted(path.name for path in data_dir.iterdir()) if data_dir.exists() else []
    assert written == (["data.mdb"] if argv[0] == "inspect" else []), "nothing was written"


@pytest.mark.parametrize("which", ["kvstore", "kvstore bench"])
def test_each_command_summary_is_the_first_paragraph_of_its_help(which: str) -> None:
    """``kvstore --help`` and ``kvstore bench --help`` list the summaries kept beside the command names; they must
    say what the commands' docstrings say."""
    group = (app if which == "kvstore" else bench_app).info.cls
    assert group is not None
    for name, lazy in group.lazy_commands.items():  # type: ignore[attr-defined]
        command = lazy.load(name)
        assert command.help is not None
        first_paragraph = " ".join(command.help.strip().split("\n\n")[0].split())
        assert first_paragraph == lazy.summary, name


def test_serve_help_shows_whole_flag_names_at_80_columns(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run(["serve", "--help"], capsys)
    assert code == 0 and "…" not in out
    assert "--enable-segmented-prefix / --disable-segmented-prefix" in out
    assert "KVSTORE_REMOTE_PASSWORD" in " ".join(out.split())
    assert max(len(line) for line in out.splitlines()) <= 80


@pytest.mark.parametrize("argv", [[], ["bench"]])
def test_a_group_alone_prints_its_help_not_an_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(argv, capsys)
    assert (
        code == 2 and err.startswith(f"Usage: kvstore {' '.join(argv)}".rstrip() + " ") and "kvstore: error" not in err
    )


def test_a_mistyped_command_is_suggested_though_not_loaded(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["serv"], capsys)
    assert code == 2 and err.strip() == "kvstore: error: No such command 'serv'. Did you mean 'serve'?"


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
