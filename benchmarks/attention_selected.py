"""How fast the blender's scattered-query attention runs, against the flash kernel on the same shapes (CUDA).

After the check layer a blended prefill computes ~15% of a prompt's tokens, scattered over it, each attending to
the keys up to its own position (``kvstore.blend.query_attention``). This times, for Llama-3.1-8B's attention
shape (32 query heads over 8 KV heads of 128) in bf16, ``--queries`` sorted random positions (the last one always
among them) over ``--keys`` keys:

- ``sdpa_one_mask``: one sdpa call with the whole additive mask (every masked-out score is computed);
- ``flex``: compiled flex attention with a block mask (mask building timed apart);
- baselines in the same run: ``flash_causal_full`` (a full prefill's causal attention over every key: the
  attention share of full-prefill TTFT) and ``flash_dense_same_pairs`` (flash attention over as many
  query-key pairs as the causal subset really has: what an ideal kernel would cost);
- ``layer_rest``: the rest of one 8B decoder layer for the same queries (q/k/v/o projections and the MLP), so the
  attention's share of a recomputed layer is visible.

Medians of ``--repeats`` CUDA-event timings after warm-up. One JSON object per line on stdout.

    python benchmarks/attention_selected.py --keys 15060 --queries 2302
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as functional

from kvstore.blend.query_attention import AttentionKernel, QueryMask

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE = 32, 8, 128, 4096, 14336


def timed_ms(work: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        work()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=15060)
    parser.add_argument("--queries", type=int, default=2302)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    num_keys, num_queries = args.keys, args.queries
    chosen = torch.randperm(num_keys - 1, device=device)[: num_queries - 1].sort().values
    positions = torch.cat([chosen, torch.tensor([num_keys - 1], device=device)])
    dtype, scale = torch.bfloat16, HEAD_DIM**-0.5
    query = torch.randn(1, HEADS, num_queries, HEAD_DIM, device=device, dtype=dtype)
    keys = torch.randn(1, KV_HEADS, num_keys, HEAD_DIM, device=device, dtype=dtype)
    values = torch.randn(1, KV_HEADS, num_keys, HEAD_DIM, device=device, dtype=dtype)
    groups = HEADS // KV_HEADS
    rows: list[dict[str, object]] = []

    def record(name: str, ms: float, **extra: object) -> None:
        rows.append({"variant": name, "ms": round(ms, 4), "keys": num_keys, "queries": num_queries, **extra})
        print(json.dumps(rows[-1]), flush=True)

    with torch.inference_mode():
        # the blend pass hands over strided views: q from [1, n, H, D] storage, K/V from the [T, Hkv, D] cache
        strided_query = torch.randn(1, num_queries, HEADS, HEAD_DIM, device=device, dtype=dtype).transpose(1, 2)
        strided_keys = torch.randn(num_keys, KV_HEADS, HEAD_DIM, device=device, dtype=dtype).permute(1, 0, 2)[None]
        strided_values = torch.randn(num_keys, KV_HEADS, HEAD_DIM, device=device, dtype=dtype).permute(1, 0, 2)[None]
        for layout_name, inputs in (("contiguous", (query, keys, values)),
                                    ("strided", (strided_query, strided_keys, strided_values))):  # fmt: skip
            mask = QueryMask(positions, num_keys, dtype, AttentionKernel.SDPA)
            reference = mask.attend(*inputs, scale=scale, kv_groups=groups)
            attend = functools.partial(mask.attend, *inputs, scale=scale, kv_groups=groups)
            record("sdpa_one_mask", timed_ms(attend, args.repeats), layout=layout_name)
            build_ms = timed_ms(lambda: QueryMask(positions, num_keys, dtype, AttentionKernel.FLEX), args.repeats)
            flex_mask = QueryMask(positions, num_keys, dtype, AttentionKernel.FLEX)
            out = flex_mask.attend(*inputs, scale=scale, kv_groups=groups)
            error = float((out.float() - reference.float()).abs().max())
            attend = functools.partial(flex_mask.attend, *inputs, scale=scale, kv_groups=groups)
            flex_ms = timed_ms(attend, args.repeats)
            record("flex", flex_ms, layout=layout_name, mask_build_ms=round(build_ms, 4),
                   max_abs_error_vs_sdpa=error)  # fmt: skip
        for small in (50, 300):  # a plain-reuse query set (gaps and the last token) and a short prompt's
            small_mask = QueryMask(positions[-small:], num_keys, dtype, AttentionKernel.FLEX)
            small_query = query[:, :, -small:]
            attend = functools.partial(small_mask.attend, small_query, keys, values, scale=scale, kv_groups=groups)
            record("flex", timed_ms(attend, args.repeats), layout="contiguous", queries_here=small)
        full_query = torch.randn(1, HEADS, num_keys, HEAD_DIM, device=device, dtype=dtype)
        record("flash_causal_full", timed_ms(lambda: functional.scaled_dot_product_attention(
            full_query, keys, values, is_causal=True, scale=scale, enable_gqa=True), args.repeats))  # fmt: skip
        pairs = int((positions + 1).sum())
        dense_keys = max(1, pairs // num_queries)
        record("flash_dense_same_pairs", timed_ms(lambda: functional.scaled_dot_product_attention(
            query, keys[:, :, :dense_keys], values[:, :, :dense_keys], scale=scale, enable_gqa=True),
            args.repeats), keys_per_query=dense_keys)  # fmt: skip
        projections = [torch.nn.Linear(HIDDEN, width, bias=False, device=device, dtype=dtype)
                       for width in (HIDDEN, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, HIDDEN)]  # fmt: skip
        gate_up = torch.nn.Linear(HIDDEN, 2 * INTERMEDIATE, bias=False, device=device, dtype=dtype)
        down = torch.nn.Linear(INTERMEDIATE, HIDDEN, bias=False, device=device, dtype=dtype)
        hidden = torch.randn(1, num_queries, HIDDEN, device=device, dtype=dtype)

        def layer_rest() -> torch.Tensor:
            for projection in projections:
                projection(hidden)
            gate, up = gate_up(hidden).chunk(2, dim=-1)
            return down(functional.silu(gate) * up)

        record("layer_rest", timed_ms(layer_rest, args.repeats))


if __name__ == "__main__":
    main()
