"""Summarise ``kvstore bench multi-doc-qa --samples`` files: fact accuracy per mode, paired with full prefill, overall
and by the slot of the asked document in the prompt; blend is also paired with plain reuse when the file has both
(the issue's "clearly better than plain reuse").

Why the slot: on SmolLM2 a blended (or reused) prompt loses planted-fact answers mostly when the asked document comes
first and later documents were cached without it in front of them (docs/benchmarks.md, "Blend quality on SmolLM2").
Only queries that finished in every mode count, so a run cut short by a time limit is summarised as far as it got.

    .venv/bin/python benchmarks/summarize_samples.py benchmarks/results/h200_quality/*.samples.jsonl.gz [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from samples_files import read_samples

from kvstore.bench.multidoc_stats import paired_facts, wilson_interval


def _complete_queries(path: Path) -> list[dict[str, dict[str, Any]]]:
    """Each query's samples by mode, keeping the queries every mode of the file finished."""
    by_query: dict[int, dict[str, dict[str, Any]]] = collections.defaultdict(dict)
    modes: set[str] = set()
    for sample in read_samples(path):
        by_query[sample["query"]][sample["mode"]] = sample
        modes.add(sample["mode"])
    return [samples for _, samples in sorted(by_query.items()) if set(samples) == modes]


def summarize(path: Path) -> list[dict[str, Any]]:
    """One row per mode other than full: accuracy, paired difference with full (and blend's with reuse), KL, and
    accuracy by asked slot."""
    queries = _complete_queries(path)
    full = [bool(query["full"]["fact_correct"]) for query in queries]
    rows = []
    for mode in sorted(set(queries[0]) - {"full"}) if queries else []:
        answers = [bool(query[mode]["fact_correct"]) for query in queries]
        paired = paired_facts(full, answers)
        interval = wilson_interval(sum(answers), len(answers))
        by_slot: dict[int, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
        for query, full_right, mode_right in zip(queries, full, answers, strict=True):
            counts = by_slot[query["full"]["order"].index(query["full"]["asked"])]
            counts[0] += 1
            counts[1] += full_right
            counts[2] += mode_right
        versus_reuse = None
        if mode == "blend" and "reuse" in queries[0]:
            versus_reuse = paired_facts([bool(query["reuse"]["fact_correct"]) for query in queries], answers)
        rows.append({
            "file": path.name, "mode": mode, "num_queries": len(queries),
            "full_accuracy": round(sum(full) / len(full), 3),
            "fact_accuracy": round(sum(answers) / len(answers), 3),
            "fact_accuracy_ci95": [round(interval.low, 3), round(interval.high, 3)],
            "difference_vs_full": round(paired.difference, 3),
            "difference_ci95": [round(paired.difference_ci95.low, 3), round(paired.difference_ci95.high, 3)],
            "full_only": paired.full_only, "mode_only": paired.mode_only,
            "top1_agreement": round(statistics.fmean(bool(query[mode]["top1"]) for query in queries), 3),
            "kl_mean": round(statistics.fmean(query[mode]["kl"] for query in queries), 4),
            "continuation_match": round(statistics.fmean(query[mode]["continuation_match"] for query in queries), 3),
            "difference_vs_reuse": None if versus_reuse is None else round(versus_reuse.difference, 3),
            "difference_vs_reuse_ci95": None if versus_reuse is None else [
                round(versus_reuse.difference_ci95.low, 3), round(versus_reuse.difference_ci95.high, 3)
            ],
            "by_asked_slot": {
                slot: {"queries": n, "full": f, "mode": m} for slot, (n, f, m) in sorted(by_slot.items())
            },
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path, help="--samples files of kvstore bench multi-doc-qa / shuffle")
    parser.add_argument("--json", action="store_true", help="one JSON object per file and mode")
    args = parser.parse_args()
    for path in args.paths:
        for row in summarize(path):
            if args.json:
                sys.stdout.write(json.dumps(row) + "\n")
                continue
            slots = " ".join(
                f"{slot}:{counts['full']}/{counts['mode']}/{counts['queries']}"
                for slot, counts in row["by_asked_slot"].items()
            )
            sys.stdout.write(
                f"{row['file']:34s} {row['mode']:6s} n={row['num_queries']:3d} full={row['full_accuracy']:.3f} "
                f"mode={row['fact_accuracy']:.3f} diff={row['difference_vs_full']:+.3f} {row['difference_ci95']} "
                f"({row['full_only']}/{row['mode_only']}) top1={row['top1_agreement']:.3f} kl={row['kl_mean']:.4f} "
                f"cm={row['continuation_match']:.3f}  slot full/mode/n: {slots}\n"
            )
            if row["difference_vs_reuse"] is not None:
                versus = f"{row['difference_vs_reuse']:+.3f} {row['difference_vs_reuse_ci95']}"
                sys.stdout.write(f"{'':41s} blend - reuse: {versus}\n")


if __name__ == "__main__":
    main()
