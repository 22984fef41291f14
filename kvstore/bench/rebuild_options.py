"""What ``kvstore bench rebuild`` builds and measures (``RebuildBenchOptions``), checked without importing torch,
numba or LMDB.

Why apart from ``kvstore.bench.rebuild``: that module imports the store, the disk tier (LMDB) and torch;
``kvstore bench rebuild`` builds these options, which check themselves, before it imports them, so a bad option is
refused in a fraction of a second. ``kvstore.bench.rebuild`` re-exports both names; the tiny KV layout and the disk
capacity, which need ``KVLayout`` (torch), are its ``bench_layout`` and ``capacity_bytes``.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvstore.bench.rag_shape import CHUNKS_PER_DOCUMENT, DOCUMENTS_PER_QUERY
from kvstore.errors import ConfigError

__all__ = ["RebuildBenchOptions", "default_data_dir"]


def default_data_dir(num_chunks: int, seed: int = 0) -> Path:
    """Where the data dir of ``num_chunks`` chunks lives unless ``--data-dir`` says otherwise (kept between runs)."""
    return Path(tempfile.gettempdir()) / f"kvstore-bench-rebuild-{num_chunks}-seed{seed}"


@dataclass(frozen=True, slots=True, kw_only=True)
class RebuildBenchOptions:
    """What ``run_rebuild_benchmark`` builds and measures.

    Args:
        num_chunks: chunks to store, rounded down to whole documents of 12 chunks (at least 5 documents).
        data_dir: the data dir (default ``default_data_dir``); built when missing, reused when its manifest
            matches, rebuilt when it is an older build of this benchmark, refused when it holds anything else.
        num_queries: lookups that check the rebuilt index.
        num_repeats: timed opens of the store, and of the baseline, alternating.
        head_dim: of the tiny KV layout (1 layer, 1 KV head, fp16).
        seed: of the documents (each document's tokens come from ``(seed, document index)``) and the queries.
        cold: drop the data dir from the page cache before each timed open.
    """

    num_chunks: int = 1_000_000
    data_dir: Path | None = None
    num_queries: int = 200
    num_repeats: int = 3
    head_dim: int = 2
    seed: int = 0
    cold: bool = False

    def __post_init__(self) -> None:
        if self.num_chunks < 1:
            raise ConfigError(f"--chunks {self.num_chunks}: give a positive chunk count, e.g. 1000000")
        if self.num_queries < 1 or self.num_repeats < 1:
            raise ConfigError("--queries and --repeats must be positive, e.g. --queries 200 --repeats 3")
        if not 1 <= self.head_dim <= 256:
            raise ConfigError(f"--head-dim {self.head_dim} must lie in [1, 256]; the default 2 keeps chunks tiny")

    @property
    def num_documents(self) -> int:
        return max(DOCUMENTS_PER_QUERY, self.num_chunks // CHUNKS_PER_DOCUMENT)

    @property
    def resolved_data_dir(self) -> Path:
        return self.data_dir if self.data_dir is not None else default_data_dir(self.num_chunks, self.seed)
