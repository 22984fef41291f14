"""Content index rebuild at open (issue 3, persistence): ``kvstore bench rebuild``.

Examples::

    .venv/bin/python benchmarks/bench_rebuild.py --chunks 100000 --json
    .venv/bin/python benchmarks/bench_rebuild.py --chunks 1000000 --json

The options are those of ``kvstore bench rebuild --help``; this script only forwards them. What each printed field
means is in ``kvstore/bench/rebuild.py``.
"""

from __future__ import annotations

import sys

from kvstore.cli.main import main

if __name__ == "__main__":
    main(["bench", "rebuild", *sys.argv[1:]])
