"""FingerprintIndex on the issue-3 workload: ``kvstore bench index``.

Examples::

    .venv/bin/python benchmarks/bench_index.py --json                      # 2.2K and 220K chunks
    .venv/bin/python benchmarks/bench_index.py --json --chunks 1000000

The options are those of ``kvstore bench index --help``; this script only forwards them. What each printed field
means is in ``kvstore/bench/index.py``.
"""

from __future__ import annotations

import sys

from kvstore.cli.main import main

if __name__ == "__main__":
    main(["bench", "index", *sys.argv[1:]])
