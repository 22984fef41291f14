"""Benchmarks behind ``kvstore bench``, each against a baseline measured in the same run."""

from kvstore.bench.tiers import TierBenchOptions, TierBenchRow, run_tier_benchmark

__all__ = ["TierBenchOptions", "TierBenchRow", "run_tier_benchmark"]
