"""What ``kvstore bench multi-doc-qa`` and ``shuffle`` measure (``MultiDocOptions`` and its choices), checked without
importing torch, numba or LMDB.

Why apart from ``kvstore.bench.multidoc``: that module imports torch, the models and the store; the CLI builds these
options, which check themselves (the blend settings through ``kvstore.blend.config``), before it imports them, so a
bad option is refused in a fraction of a second. ``kvstore.bench.multidoc`` re-exports the options and the enums,
``kvstore.bench.multidoc_workload`` ``FactStyle`` and uses ``check_docs_per_query``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.blend.config import BlendConfig
from kvstore.chunking import Chunking, parse_chunking
from kvstore.config import GIB
from kvstore.errors import ConfigError
from kvstore.models.random_init_names import check_random_init_preset
from kvstore.tiers.names import TierName

__all__ = [
    "BenchMode",
    "BenchWorkload",
    "FactStyle",
    "MultiDocOptions",
    "WarmUp",
    "check_docs_per_query",
]


def check_docs_per_query(docs_per_query: int, num_documents: int, *, documents_flag: str = "--num-documents") -> None:
    """Raise ``ConfigError`` unless a query can hold ``docs_per_query`` distinct documents of ``num_documents``
    (``documents_flag``: the flag that set ``num_documents``, named in the message)."""
    if not 1 <= docs_per_query <= num_documents:
        raise ConfigError(f"--docs-per-query {docs_per_query} must be between 1 and {documents_flag} {num_documents}")


class BenchWorkload(enum.StrEnum):
    MULTI_DOC_QA = "multi_doc_qa"
    SHUFFLE = "shuffle"


class WarmUp(enum.StrEnum):
    """How multi-doc-qa's warm-up stores each document (see ``kvstore.bench.multidoc_workload``)."""

    PREAMBLE = "preamble"
    ALONE = "alone"
    GROUPED = "grouped"


class BenchMode(enum.StrEnum):
    FULL = "full"
    PREFIX = "prefix"
    BLEND = "blend"
    REUSE = "reuse"


class FactStyle(enum.StrEnum):
    """Which relation each planted fact states (see the module docstring)."""

    DISTINCT = "distinct"
    SAME = "same"


@dataclass(frozen=True, slots=True, kw_only=True)
class MultiDocOptions:
    """What ``run_multidoc_benchmark`` measures; the CLI flags of the same names document each field."""

    workload: BenchWorkload = BenchWorkload.MULTI_DOC_QA
    model_path: Path | None = None
    model_cache_dir: Path | None = None
    random_init: str | None = None
    num_layers: int | None = None
    device: str = "auto"
    dtype: str = "auto"
    tiers: tuple[TierName, ...] = (TierName.CPU,)
    data_dir: Path | None = None
    chunk_size: int = 64  # a document's head up to a chunk is a gap (its first chunk holds the preamble)
    chunking: Chunking = Chunking.FIXED  # the store's cut rule (StoreConfig.chunking)
    warm_up: WarmUp = WarmUp.PREAMBLE
    facts: FactStyle = FactStyle.DISTINCT
    cpu_capacity_bytes: int | None = None
    gpu_capacity_bytes: int | None = None
    disk_capacity_bytes: int = 64 * GIB
    num_documents: int = 8
    document_tokens: int = 512
    num_queries: int = 10
    docs_per_query: int = 4
    blend: BlendConfig = field(default_factory=BlendConfig)  # blend mode's settings; reuse is the same at ratio 0
    modes: tuple[BenchMode, ...] = tuple(BenchMode)
    continuation_tokens: int = 32
    seed: int = 0
    samples_path: Path | None = None  # one JSON line per query and mode, written as they come

    def __post_init__(self) -> None:
        object.__setattr__(self, "workload", BenchWorkload(self.workload))
        object.__setattr__(self, "warm_up", WarmUp(self.warm_up))
        object.__setattr__(self, "chunking", parse_chunking(self.chunking))
        object.__setattr__(self, "facts", FactStyle(self.facts))
        modes = [BenchMode(mode) for mode in self.modes]
        # full prefill runs first, asked for or not: it is the reference every quality figure and ratio compares with
        others = tuple(dict.fromkeys(mode for mode in modes if mode is not BenchMode.FULL))
        object.__setattr__(self, "modes", (BenchMode.FULL, *others))
        if self.samples_path is not None and not self.samples_path.parent.is_dir():  # before minutes of work
            raise ConfigError(f"--samples {self.samples_path}: its directory does not exist")
        if self.model_path is not None and self.random_init is not None:
            raise ConfigError("--model and --random-init exclude each other; pick one model")
        if self.random_init is not None:
            check_random_init_preset(self.random_init)
        for name in ("num_documents", "document_tokens", "num_queries", "continuation_tokens", "chunk_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')}={getattr(self, name)} must be at least 1")
        if self.workload is BenchWorkload.MULTI_DOC_QA:
            check_docs_per_query(self.docs_per_query, self.num_documents)
