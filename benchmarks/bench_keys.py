"""Time to compute the prefix keys of 1M tokens (target: under 50 ms), against hashing the same bytes in one call.

Run: .venv/bin/python benchmarks/bench_keys.py [--tokens 1000000] [--repeats 20] [--json]
Prints one JSON object per input kind (numpy int64 array, Python list) with the median/p90/max ms, the
baseline (one xxh3_128 over the whole uint32 buffer: the hashing floor) and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import xxhash

from kvstore.keys import as_token_array, prefix_keys
from kvstore.presets import preset_layout


def _times_ms(function: Callable[[], object], repeats: int) -> list[float]:
    function()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        samples.append((time.perf_counter() - started) * 1e3)
    return sorted(samples)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    namespace = preset_layout("llama3.1-8b").namespace
    array = np.random.default_rng(0).integers(0, 128_000, size=args.tokens, dtype=np.int64)
    inputs = {"numpy_int64": array, "python_list": array.tolist()}
    baseline = _times_ms(lambda: xxhash.xxh3_128_digest(array.astype("<u4").tobytes()), args.repeats)
    for kind, tokens in inputs.items():
        samples = _times_ms(
            lambda t=tokens: prefix_keys(namespace, as_token_array(t), args.chunk_size), args.repeats
        )
        row = {
            "bench": "keys",
            "input": kind,
            "tokens": args.tokens,
            "chunk_size": args.chunk_size,
            "ms_p50": round(statistics.median(samples), 3),
            "ms_p90": round(samples[int(0.9 * (len(samples) - 1))], 3),
            "ms_max": round(samples[-1], 3),
            "baseline": "xxh3_128 of the whole uint32 buffer, one call",
            "baseline_ms_p50": round(statistics.median(baseline), 3),
            "ratio": round(statistics.median(samples) / statistics.median(baseline), 2),
            "target_ms": 50.0,
            "met": statistics.median(samples) < 50.0,
        }
        print(json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
