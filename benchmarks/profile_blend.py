"""Where a blended prefill's GPU time goes: ``kvstore bench multi-doc-qa`` under ``torch.profiler`` (CUDA).

Runs the bench with the given arguments (a few queries are enough; full prefill always runs beside blend) and
prints the operators and kernels by total CUDA time, so the overhead around flex attention and the MLP shows.
Profiling slows the host, so read the shares, not the milliseconds.

    python benchmarks/profile_blend.py --random-init llama3.1-8b --device cuda --dtype bfloat16 --tiers cpu \\
        --num-documents 5 --document-tokens 3000 --docs-per-query 5 --warm-up alone --chunk-size 256 \\
        --num-queries 2 --modes blend --json
"""

from __future__ import annotations

import contextlib
import sys

from torch.profiler import ProfilerActivity, profile

from kvstore.cli.main import main


def run() -> None:
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities) as profiler, contextlib.suppress(SystemExit):
        main(["bench", "multi-doc-qa", *sys.argv[1:]])
    table = profiler.key_averages().table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=70)
    sys.stderr.write(table + "\n")


if __name__ == "__main__":
    run()
