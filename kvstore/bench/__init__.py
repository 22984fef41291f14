"""Benchmarks behind ``kvstore bench``, each against a baseline measured in the same run.

The names are re-exported lazily (``kvstore.lazy_exports``): ``kvstore bench vllm`` imports ``kvstore.bench.vllm_ttft``
and must not pay for the store's benchmarks (the content index, LMDB, numba) to check its arguments (issue 45).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from kvstore.bench.index import IndexBenchRow, run_index_benchmark
    from kvstore.bench.multidoc import MultiDocOptions, run_multidoc_benchmark
    from kvstore.bench.multidoc_rows import MultiDocRow
    from kvstore.bench.rebuild import RebuildBenchOptions, RebuildBenchRow, run_rebuild_benchmark
    from kvstore.bench.tiers import TierBenchOptions, TierBenchRow, run_tier_benchmark

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "kvstore.bench.index": ("IndexBenchRow", "run_index_benchmark"),
        "kvstore.bench.multidoc": ("MultiDocOptions", "run_multidoc_benchmark"),
        "kvstore.bench.multidoc_rows": ("MultiDocRow",),
        "kvstore.bench.rebuild": ("RebuildBenchOptions", "RebuildBenchRow", "run_rebuild_benchmark"),
        "kvstore.bench.tiers": ("TierBenchOptions", "TierBenchRow", "run_tier_benchmark"),
    },
)
__all__ = [
    "IndexBenchRow",
    "MultiDocOptions",
    "MultiDocRow",
    "RebuildBenchOptions",
    "RebuildBenchRow",
    "TierBenchOptions",
    "TierBenchRow",
    "run_index_benchmark",
    "run_multidoc_benchmark",
    "run_rebuild_benchmark",
    "run_tier_benchmark",
]
