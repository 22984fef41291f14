"""Code samples in the README and docs/ run as written -- twice, in a directory where ``make run`` already ran
(its ``./kvstore-data`` in place), as a newcomer runs them from the repository root."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.DOTALL)


SAMPLES = [
    pytest.param(block, id=f"{path.name}-{index}")
    for path in DOCUMENTS
    for index, block in enumerate(python_blocks(path))
]


@pytest.fixture(scope="module")
def after_make_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory in which ``make run``'s command (``kvstore serve --data-dir ./kvstore-data``) ran and stopped."""
    root = tmp_path_factory.mktemp("repo-root")
    command = [sys.executable, "-m", "kvstore.cli.main", "serve", "--data-dir", "./kvstore-data"]
    with subprocess.Popen(
        [*command, "--port", "0", "--metrics-port", "0"], cwd=root, stdout=subprocess.PIPE, text=True
    ) as server:
        assert server.stdout is not None
        for line in server.stdout:
            if "listening on" in line:
                break
        server.send_signal(signal.SIGINT)  # Ctrl-C
        assert server.wait(60) == 0
    return root


@pytest.mark.parametrize("source", SAMPLES)
def test_sample_runs_twice_after_make_run(source: str, after_make_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(after_make_run)
    for _ in range(2):  # a second run meets the data the first one left in ./kvstore-data
        exec(compile(source, "<doc sample>", "exec"), {"__name__": "doc_sample"})


def test_there_are_samples() -> None:
    assert any("TieredStore" in sample.values[0] for sample in SAMPLES)
