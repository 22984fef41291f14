"""What content-defined chunks cost a lookup: an in-process ``TieredStore.lookup`` of a prompt cached whole, fixed
against content chunks in the same run, with blending off and on, as an exact prefix and moved behind other tokens.

Run: .venv/bin/python benchmarks/bench_chunking_lookup.py [--tokens 15360] [--lookups 200] [--chunk-size 256] [--json]
Prints one JSON object per (chunking, blend, prompt) with the chunks planned, the tokens found and the p50/p90/max
ms of lookup + release (the SmolLM2 layout, a cpu tier holding every chunk, random token ids).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from kvstore import StoreConfig, TieredStore
from kvstore.chunking import Chunking
from kvstore.keys import as_token_array, chunk_bounds
from kvstore.presets import preset_layout
from kvstore.tiers.base import TierName


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=15_360)
    parser.add_argument("--lookups", type=int, default=200)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    layout = preset_layout("smollm2-135m")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50_000, args.tokens)
    prompts = {"prefix": tokens, "moved": np.concatenate([rng.integers(0, 50_000, 37), tokens])}
    kv = torch.zeros(layout.chunk_shape(args.tokens), dtype=layout.dtype.torch_dtype)
    for blend in (False, True):
        for chunking in Chunking:
            num_chunks = len(chunk_bounds(as_token_array(tokens), args.chunk_size, (), chunking)) - 1
            config = StoreConfig(
                tiers=(TierName.CPU,), chunk_size=args.chunk_size, chunking=chunking, enable_blend=blend,
                cpu_capacity_bytes=layout.chunk_bytes(args.chunk_size) * (num_chunks + 8),
            )  # fmt: skip
            with TieredStore(layout, config) as store:
                store.store(tokens, kv)
                for name, prompt in prompts.items():
                    for _ in range(10):
                        store.release(store.lookup(prompt))
                    samples = []
                    for _ in range(args.lookups):
                        started = time.perf_counter()
                        plan = store.lookup(prompt)
                        store.release(plan)
                        samples.append((time.perf_counter() - started) * 1e3)
                    samples.sort()
                    row = {
                        "chunking": chunking.value, "blend": blend, "prompt": name, "num_tokens": len(prompt),
                        "num_segments": len(plan.segments), "found_tokens": sum(s.num_tokens for s in plan.segments),
                        "p50_ms": samples[len(samples) // 2], "p90_ms": samples[int(0.9 * (len(samples) - 1))],
                        "max_ms": samples[-1],
                    }  # fmt: skip
                    print(json.dumps(row) if args.json else row)


if __name__ == "__main__":
    main()
