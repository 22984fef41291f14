"""Benchmarks behind ``kvstore bench``, each against a baseline measured in the same run.

Only what a ``kvstore bench`` command runs lives here, since the wheel ships it: the harnesses only tests start (a
Valkey cluster) are in ``tests/harness``, one-off studies in ``benchmarks/``.

The names are re-exported lazily (``kvstore.lazy_exports``): ``kvstore bench vllm`` imports ``kvstore.bench.vllm_ttft``
and must not pay for the store's benchmarks (the content index, LMDB, numba) to check its arguments. Each
benchmark's options live in a torch-free module of their own (``tier_options``, ``rebuild_options``,
``server_options``, ``multidoc_options``, ``vllm_blend_options``, checks shared through ``option_checks``), so that
``kvstore bench ...`` refuses a bad option before it imports the benchmark. ``tests/test_imports.py`` imports each
module alone and fails if it loads a module its own import statements do not reach.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from kvstore.bench.index import IndexBenchRow, run_index_benchmark
    from kvstore.bench.multidoc import run_multidoc_benchmark
    from kvstore.bench.multidoc_options import MultiDocOptions
    from kvstore.bench.multidoc_rows import MultiDocRow
    from kvstore.bench.rebuild import RebuildBenchRow, run_rebuild_benchmark
    from kvstore.bench.rebuild_options import RebuildBenchOptions
    from kvstore.bench.tier_options import TierBenchOptions
    from kvstore.bench.tiers import TierBenchRow, run_tier_benchmark

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "kvstore.bench.index": ("IndexBenchRow", "run_index_benchmark"),
        "kvstore.bench.multidoc": ("run_multidoc_benchmark",),
        "kvstore.bench.multidoc_options": ("MultiDocOptions",),
        "kvstore.bench.multidoc_rows": ("MultiDocRow",),
        "kvstore.bench.rebuild": ("RebuildBenchRow", "run_rebuild_benchmark"),
        "kvstore.bench.rebuild_options": ("RebuildBenchOptions",),
        "kvstore.bench.tier_options": ("TierBenchOptions",),
        "kvstore.bench.tiers": ("TierBenchRow", "run_tier_benchmark"),
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
