"""Start a command as nobody's child: the embedded server's launcher, run as a script (``python -I -S FILE``).

Why a grandchild: vLLM stops an engine by SIGKILLing the engine-core process and every descendant of it (psutil's
``children(recursive=True)``, which follows parent pids, not sessions or process groups). A server started as a
child of the worker, even in a session of its own, is therefore killed with the engine, before it can flush the disk
writes it has acknowledged. Started from this short-lived launcher instead, the server is reparented (to init or the
nearest subreaper) as soon as the launcher exits, so no engine shutdown reaches it; it still stops with the engine,
flushed, because it is told to (``kvstore serve --exit-with-pid``). A process group of its own keeps a terminal's
Ctrl-C, which goes to the engine's whole (foreground) process group, away from it.

Not a session of its own: Linux's autogroup scheduler (``kernel.sched_autogroup_enabled``, on by default) puts each
session in a CPU group of its own, and a server alone in its group next to an engine whose tensor-parallel ranks
busy-poll every core got almost no CPU for minutes (measured on two cores: the first disk load of a restarted TP=2
engine waited 30 s for a reply, then 30 s more for its release, with the server's threads runnable and never run; the
same server in the engine's session loaded it). In the engine's session it shares the CPU with the engine's threads
as one of them.

The launcher imports only the standard library (``-I -S``: no site-packages, no ``kvstore`` import, no coverage
hooks), so it costs the engine's start a bare interpreter's start-up.

Usage: ``python -I -S detached_start.py LOG CPUS COMMAND...`` prints the new process's pid and exits 0. ``LOG`` gets
its stdout and stderr (appended); ``CPUS`` is a ``;``-separated list of CPU sets to try in order (``0,1;0,1,2,3``;
empty: keep the launcher's), set before the command starts so that its every thread inherits it.
"""

from __future__ import annotations

import os
import subprocess
import sys

__all__ = ["main"]


def main(argv: list[str]) -> int:
    """Start ``argv[2:]`` detached (see the module docstring); print its pid. Returns the launcher's exit status."""
    if len(argv) < 3:
        sys.stderr.write("usage: detached_start.py LOG CPUS COMMAND...\n")
        return 2
    log_path, cpu_choices, *command = argv
    _set_cpus(cpu_choices)
    with open(log_path, "ab") as log:
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, process_group=0)
    sys.stdout.write(f"{child.pid}\n")
    sys.stdout.flush()
    return 0


def _set_cpus(cpu_choices: str) -> None:
    """Bind this launcher (and so the command) to the first CPU set the system allows (a cpuset may forbid one)."""
    if not hasattr(os, "sched_setaffinity"):
        return
    for choice in filter(None, cpu_choices.split(";")):
        try:
            os.sched_setaffinity(0, {int(cpu) for cpu in choice.split(",")})
        except (OSError, ValueError):
            continue
        return


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
