"""How long each CLI mistake takes to be refused, against ``kvstore --version`` measured in the same run (issue 45,
item 9: every refusal in <= 0.5 s).

Each round runs ``kvstore --version`` and then every mistake of ``tests/cli/cli_mistakes.py`` once, as a user would
(the ``kvstore`` console script of this interpreter's environment, a fresh process each, wall time from spawn to
exit); the figures are the median and the max over ``--repeats`` rounds. The ``kvstore bench`` mistakes are among
them; ``--no-bench`` leaves them out, ``--only TEXT`` keeps the mistakes whose name holds TEXT (``--only bench``).

    .venv/bin/python benchmarks/cli_refusal_times.py --repeats 5 [--no-bench] [--only TEXT] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tests.cli.cli_mistakes import Mistake, cli_mistakes  # noqa: E402

_TARGET_S = 0.5


def _kvstore() -> list[str]:
    script = Path(sys.executable).parent / "kvstore"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "kvstore.cli.main"]


def _time(argv: tuple[str, ...], scratch: Path, env: dict[str, str], timeout_s: float) -> tuple[float, int, str]:
    """Wall time, exit code and last stderr line of one run; a command still running after ``timeout_s`` (a
    server that started instead of refusing) is killed and reported with exit code -9."""
    started = time.perf_counter()
    try:
        completed = subprocess.run(
            [*_kvstore(), *argv], cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return time.perf_counter() - started, -9, "still running: killed"
    elapsed = time.perf_counter() - started
    lines = [line for line in completed.stderr.splitlines() if line.strip()]
    return elapsed, completed.returncode, lines[-1] if lines else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="Rounds (each: --version, then every mistake).")
    parser.add_argument("--no-bench", action="store_true", help="Leave out the kvstore bench mistakes.")
    parser.add_argument("--json", action="store_true", help="One JSON object per mistake.")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="Kill a command that runs longer.")
    parser.add_argument("--only", default="", help="Only the mistakes whose name contains this text.")
    parser.add_argument(
        "--pythonpath",
        default=None,
        help="Time another checkout's kvstore: a dir holding its kvstore package (git archive REV kvstore | tar -x).",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvstore-refusals-") as directory:
        scratch = Path(directory)
        mistakes: list[Mistake] = [
            mistake
            for mistake in cli_mistakes(scratch)
            if args.only in mistake.name and not (args.no_bench and mistake.argv[0] == "bench")
        ]
        extra = {"PYTHONPATH": args.pythonpath} if args.pythonpath else {}
        baseline = Mistake(name="kvstore --version (baseline)", argv=("--version",), fragment="", exit_code=0)
        timings: dict[str, list[float]] = {m.name: [] for m in [baseline, *mistakes]}
        outcomes: dict[str, tuple[int, str]] = {}
        for _ in range(args.repeats):
            for mistake in [baseline, *mistakes]:
                env = {**os.environ, **extra, **mistake.env}
                elapsed, code, line = _time(mistake.argv, scratch, env, args.timeout_s)
                timings[mistake.name].append(elapsed)
                outcomes[mistake.name] = (code, line)
    version_s = statistics.median(timings[baseline.name])
    rows = []
    for mistake in [baseline, *mistakes]:
        samples = timings[mistake.name]
        code, line = outcomes[mistake.name]
        rows.append(
            {
                "mistake": mistake.name,
                "command": "kvstore " + " ".join(mistake.argv),
                "median_s": round(statistics.median(samples), 3),
                "max_s": round(max(samples), 3),
                "vs_version": round(statistics.median(samples) / version_s, 2),
                "exit_code": code,
                "refused_as_expected": code == mistake.exit_code and mistake.fragment in line,
                "under_target": statistics.median(samples) <= _TARGET_S,
            }
        )
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return
    width = max(len(str(row["mistake"])) for row in rows)
    print(f"{'mistake':<{width}}  median s  max s  vs --version  exit  refused  <= {_TARGET_S} s")
    for row in rows:
        print(
            f"{row['mistake']:<{width}}  {row['median_s']:>8.3f}  {row['max_s']:>5.3f}  {row['vs_version']:>12.2f}  "
            f"{row['exit_code']:>4}  {'yes' if row['refused_as_expected'] else 'NO':>7}  "
            f"{'yes' if row['under_target'] else 'NO'}"
        )
    refused = [row for row in rows[1:] if row["refused_as_expected"] and row["under_target"]]
    summary = f"{len(refused)} of {len(rows) - 1} mistakes refused as expected in <= {_TARGET_S} s"
    print(f"{summary} (median of {args.repeats})")


if __name__ == "__main__":
    main()
