"""Put/get bandwidth of each tier against a baseline measured in the same run: ``kvstore bench tiers``.

Examples::

    .venv/bin/python benchmarks/bench_tiers.py --json                   # every tier (gpu skipped without CUDA)
    .venv/bin/python benchmarks/bench_tiers.py --json --tiers cpu,disk --disk-size 256MiB
    .venv/bin/python benchmarks/bench_tiers.py --tiers gpu --device cpu --gpu-size 64MiB   # smoke test

The options are those of ``kvstore bench tiers --help``; this script only forwards them.
"""

from __future__ import annotations

import sys

from kvstore.cli.main import main

if __name__ == "__main__":
    main(["bench", "tiers", *sys.argv[1:]])
