"""Code samples in the README and docs/ run as written."""

from __future__ import annotations

import re
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


@pytest.mark.parametrize("source", SAMPLES)
def test_sample_runs(source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    exec(compile(source, "<doc sample>", "exec"), {"__name__": "doc_sample"})


def test_there_are_samples() -> None:
    assert any("TieredStore" in sample.values[0] for sample in SAMPLES)
