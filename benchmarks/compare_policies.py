"""Pair the blend mode of several ``kvstore bench multi-doc-qa --samples`` runs query by query: each run against full
prefill, plain reuse and a baseline run's blend (the selection policy in use today), on the queries every run
finished. The runs must share the workload (same seed and documents), differing only in their blend settings.

Why pair across runs: each run has its own full prefill, but with one seed every run asks the same queries in the same
order, so a policy's answers can be set against the baseline's on the same query (Agresti-Min 95% intervals), which
is far tighter than comparing two accuracies.

    .venv/bin/python benchmarks/compare_policies.py --baseline kvd15 DIR/*.samples.jsonl [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path
from typing import Any

from samples_files import read_samples, run_name

from kvstore.bench.multidoc_stats import paired_facts

_MODES = ("full", "blend", "reuse")


def _load(path: Path) -> dict[int, dict[str, dict[str, Any]]]:
    by_query: dict[int, dict[str, dict[str, Any]]] = collections.defaultdict(dict)
    for sample in read_samples(path):
        by_query[sample["query"]][sample["mode"]] = sample
    return {query: modes for query, modes in by_query.items() if all(mode in modes for mode in _MODES)}


def compare(runs: dict[str, dict[int, dict[str, dict[str, Any]]]], baseline: str) -> list[dict[str, Any]]:
    """One row per run: accuracies and KL on the common queries, and the paired differences."""
    common = sorted(set.intersection(*(set(samples) for samples in runs.values())))

    def answers(name: str, mode: str) -> list[bool]:
        return [bool(runs[name][query][mode]["fact_correct"]) for query in common]

    rows = []
    for name in runs:
        blend = answers(name, "blend")
        row: dict[str, Any] = {
            "run": name,
            "queries": len(common),
            "full": sum(answers(name, "full")) / len(common),
            "blend": sum(blend) / len(common),
            "reuse": sum(answers(name, "reuse")) / len(common),
            "blend_kl": sum(runs[name][query]["blend"]["kl"] for query in common) / len(common),
            "recomputed_tokens": sum(runs[name][query]["blend"]["recomputed_tokens"] for query in common) / len(common),
        }
        for against, reference in (("full", answers(name, "full")), ("reuse", answers(name, "reuse")),
                                   ("baseline", answers(baseline, "blend"))):  # fmt: skip
            paired = paired_facts(reference, blend)
            row[f"vs_{against}"] = paired.difference
            row[f"vs_{against}_ci95"] = [paired.difference_ci95.low, paired.difference_ci95.high]
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="the run: its file name less .samples.jsonl[.gz]")
    parser.add_argument("--json", action="store_true", help="one JSON row per run")
    parser.add_argument("samples", type=Path, nargs="+")
    args = parser.parse_args()
    runs = {run_name(path): _load(path) for path in args.samples}
    if args.baseline not in runs:
        parser.error(f"--baseline {args.baseline!r} is not one of the runs: {', '.join(runs)}")
    for row in compare(runs, args.baseline):
        if args.json:
            print(json.dumps(row))
            continue
        ci = {key: f"({row[key][0]:+.3f}, {row[key][1]:+.3f})" for key in row if key.endswith("_ci95")}
        print(f"{row['run']:10s} n={row['queries']} full {row['full']:.3f} blend {row['blend']:.3f} "
              f"reuse {row['reuse']:.3f} KL {row['blend_kl']:.4f} | vs full {row['vs_full']:+.3f} {ci['vs_full_ci95']}"
              f" | vs baseline {row['vs_baseline']:+.3f} {ci['vs_baseline_ci95']} | vs reuse {row['vs_reuse']:+.3f} "
              f"{ci['vs_reuse_ci95']}")  # fmt: skip


if __name__ == "__main__":
    main()
