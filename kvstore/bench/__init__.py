"""Benchmarks behind ``kvstore bench``, each against a baseline measured in the same run."""

from kvstore.bench.index import IndexBenchRow, run_index_benchmark
from kvstore.bench.multidoc import MultiDocOptions, run_multidoc_benchmark
from kvstore.bench.multidoc_rows import MultiDocRow
from kvstore.bench.rebuild import RebuildBenchOptions, RebuildBenchRow, run_rebuild_benchmark
from kvstore.bench.tiers import TierBenchOptions, TierBenchRow, run_tier_benchmark

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
