"""What ``kvstore bench vllm --blend`` runs (``VllmBlendOptions``), checked without importing torch, numba or LMDB.

Why apart from ``kvstore.bench.vllm_blend``: that module imports torch (the standalone blender) and numpy;
``kvstore bench vllm`` builds these options, which check themselves, before it exports or loads a model, so a bad
option is refused in a fraction of a second. ``kvstore.bench.vllm_blend`` re-exports ``VllmBlendOptions``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvstore.bench.multidoc_options import check_docs_per_query
from kvstore.blend.config import check_recompute_ratio
from kvstore.errors import ConfigError

__all__ = ["VllmBlendOptions"]


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmBlendOptions:
    """What ``kvstore bench vllm --blend`` runs.

    Args:
        model_dir: the vLLM model directory (SmolLM2 exported for vLLM).
        num_documents: documents cached alone.
        document_tokens: tokens per document.
        docs_per_query: documents in each query (between 1 and ``num_documents``).
        num_queries: queries (samples per row).
        ratio: the blend's recompute ratio, in ``[0, 1]``.
        answer_tokens: greedy tokens generated per query (to read the answer's number).
        chunk_size: the store's chunk size.
        engine_timeout_s: the longest one engine session may take.
    """

    model_dir: Path
    num_documents: int = 5
    document_tokens: int = 1000
    docs_per_query: int = 5
    num_queries: int = 3
    ratio: float = 0.15
    answer_tokens: int = 12
    chunk_size: int = 256
    engine_timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.num_queries < 1 or self.num_documents < 1:
            raise ConfigError("--prompts and the document count must be at least 1")
        check_docs_per_query(self.docs_per_query, self.num_documents, documents_flag="--documents")
        check_recompute_ratio(self.ratio)
