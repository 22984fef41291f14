"""The embedded server's launcher, run in process here (the engine runs it as a bare script, which coverage cannot
follow): it starts the command in a process group of its own (in the launcher's session, so Linux's autogroup
scheduler keeps it in the engine's CPU group), bound to the first CPU set allowed, and prints its pid."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from kvstore.connectors.detached_start import main


# The launcher drops its Popen while the child runs, by design (it exits at once as a script); in process that is a
# ResourceWarning when the object is collected.
@pytest.mark.filterwarnings("ignore::ResourceWarning", "ignore::pytest.PytestUnraisableExceptionWarning")
def test_the_command_leads_a_process_group_in_the_launchers_session_with_its_output_in_the_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "server.log"
    script = "import os; print(os.getpgid(0) == os.getpid(), os.getsid(0), sorted(os.sched_getaffinity(0)))"
    allowed = sorted(os.sched_getaffinity(0))
    choices = f"99999;{allowed[0]}"  # the first set is refused by the system: the next one is taken
    assert main([str(log), choices, sys.executable, "-c", script]) == 0
    pid = int(capsys.readouterr().out.strip())
    _, status = os.waitpid(pid, 0)  # started from this process here: its child until it exits
    assert os.waitstatus_to_exitcode(status) == 0
    assert log.read_text().split() == ["True", str(os.getsid(0)), f"[{allowed[0]}]"]


def test_a_launch_without_a_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["only-a-log"]) == 2
    assert "usage: detached_start.py LOG CPUS COMMAND" in capsys.readouterr().err
