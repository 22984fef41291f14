"""Read the ``--samples`` files of ``kvstore bench multi-doc-qa`` / ``shuffle``: one JSON object per query and mode.

The bench writes them as plain ``NAME.samples.jsonl``; those kept in ``benchmarks/results`` are gzipped
(``NAME.samples.jsonl.gz``, a sixth of the bytes: docs/contributing.md says what is kept there). The summary scripts
read both, so a run is summarised the same before and after it is filed.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

SUFFIXES = (".samples.jsonl.gz", ".samples.jsonl")


def read_samples(path: Path) -> list[dict[str, Any]]:
    """Every sample of a file, gzipped (``.gz``) or not, in the order written."""
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    return [json.loads(line) for line in text.splitlines()]


def run_name(path: Path) -> str:
    """The run a samples file holds: its name without ``.samples.jsonl`` (and ``.gz``)."""
    for suffix in SUFFIXES:
        if path.name.endswith(suffix):
            return path.name.removesuffix(suffix)
    return path.name
