"""``kvstore bench vllm --prefill-decode``: a prefill/decode split on one kvstore, against a single engine in the same
run.

Three sessions on ``num_prompts`` prompts of prose, each opened by a warm-up prompt W (not in the rows):

    session            prompts                  rows
    cold               W, P1, P2, ...           cold: one engine, no connector, no prefix cache; its greedy outputs
                                                (``decode_tokens`` each) are what the decode engine must answer
    vllm prefix cache  W, W, P1, P1, P2, P2...  vllm_prefix_hit: the repeats, served by vLLM's own prefix cache
    prefill/decode     W, P1, P2, ... through   pd_prefill: the prefill engine (``kv_producer``, one token; its
                       ``PrefillDecodeProxy``   answer waits for the save); pd_decode: the decode engine
                                                (``kv_consumer``): its TTFT is a load from the store; pd_end_to_end:
                                                what the proxy's client waits, from the prefill call to the decode
                                                engine's first token

Both engines of the split run in one driver process (``vllm_pd_engines``), each with its own engine core, on one
embedded ``kvstore serve`` (the same ``kvstore.data_dir``: the first connector starts it, the other finds it). The
decode rows say how many outputs equal the cold engine's (``outputs_equal``).
"""

from __future__ import annotations

import json
import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from kvstore.bench.pd_proxy import RoutedRequest
from kvstore.bench.vllm_engine import EngineSpec, RequestResult
from kvstore.bench.vllm_pd_engines import prefill_decode_command
from kvstore.bench.vllm_ttft import (
    CONNECTOR_CONFIG,
    CPU_ENGINE_ENV,
    VllmBenchOptions,
    VllmBenchRow,
    bench_row,
    run_driver,
    run_engine_session,
)
from kvstore.errors import ConfigError

__all__ = ["DECODE_TOKENS", "run_prefill_decode_benchmark", "run_split_session"]

DECODE_TOKENS = 16
"""Greedy tokens the decode engine (and the cold engine it is compared with) generates per prompt."""
PD_KV_CACHE_GIB = "2"
"""Each engine's ``VLLM_CPU_KVCACHE_SPACE``: two engines share the host."""


def run_prefill_decode_benchmark(
    options: VllmBenchOptions, prompts: Sequence[Sequence[int]], progress: Callable[[str], None] = lambda _: None
) -> list[VllmBenchRow]:
    """Run the three sessions; one row per mode, cold first.

    Args:
        prompts: the warm-up prompt first, then the measured ones (``prose_prompts(..., num_prompts + 1, ...)``).
    """
    if len(prompts) < 2:
        raise ConfigError("the prefill/decode benchmark needs a warm-up prompt and at least one measured prompt")
    env = {**CPU_ENGINE_ENV, "VLLM_CPU_KVCACHE_SPACE": PD_KV_CACHE_GIB, **(options.env or {})}
    spec = EngineSpec(
        model_dir=options.model_dir, prompts=prompts, max_tokens=DECODE_TOKENS, dtype=options.dtype, env=env
    )
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-vllm-pd-") as scratch:
        progress(f"vLLM session: cold ({len(prompts)} requests)")
        cold = run_engine_session(spec, options.engine_timeout_s)
        pairs = [prompt for prompt in prompts for _ in range(2)]
        progress(f"vLLM session: vllm prefix cache ({len(pairs)} requests)")
        prefix = run_engine_session(
            replace(spec, prompts=pairs, max_tokens=1, enable_prefix_caching=True), options.engine_timeout_s
        )
        data_dir = options.data_dir or Path(scratch) / "kvstore-data"
        extra = {"kvstore.data_dir": str(data_dir), "kvstore.tiers": "cpu,disk", "kvstore.cpu_size": "2GiB"}
        progress(f"vLLM session: prefill/decode ({len(prompts)} requests, two engines)")
        routed = run_split_session(
            replace(
                spec,
                kv_transfer_config={**CONNECTOR_CONFIG, "kv_role": "kv_producer", "kv_connector_extra_config": extra},
            ),
            replace(
                spec,
                kv_transfer_config={**CONNECTOR_CONFIG, "kv_role": "kv_consumer", "kv_connector_extra_config": extra},
            ),
            options.engine_timeout_s,
        )
    measured, reference = routed[1:], cold[1:]
    equal = sum(
        request.decode.token_ids == single.token_ids for request, single in zip(measured, reference, strict=True)
    )
    cold_p50 = statistics.median(1000 * (result.ttft_s or 0.0) for result in reference)
    prompt_tokens = len(prompts[0])
    decoded = [request.decode for request in measured]
    return [
        bench_row("cold", reference, prompt_tokens, cold_p50),
        bench_row("vllm_prefix_hit", prefix[3::2], prompt_tokens, cold_p50),
        bench_row("pd_prefill", [request.prefill for request in measured], prompt_tokens, cold_p50),
        bench_row("pd_decode", decoded, prompt_tokens, cold_p50, outputs_equal=(equal, len(measured))),
        bench_row(
            "pd_end_to_end",
            decoded,
            prompt_tokens,
            cold_p50,
            ttft_ms=[1000 * (request.ttft_s or 0.0) for request in measured],
            outputs_equal=(equal, len(measured)),
        ),
    ]


def run_split_session(prefill: EngineSpec, decode: EngineSpec, timeout_s: float) -> list[RoutedRequest]:
    """The two engines in one driver subprocess (``vllm_pd_engines``), each of ``decode``'s prompts through the
    proxy; its log goes to this process's stderr only when it fails."""
    spec = json.dumps({"prefill": json.loads(prefill.to_json()), "decode": json.loads(decode.to_json())})
    lines = run_driver(prefill_decode_command(), spec, len(decode.prompts), timeout_s)
    return [_routed(json.loads(line)) for line in lines]


def _routed(line: dict[str, object]) -> RoutedRequest:
    return RoutedRequest(
        prefill=RequestResult.from_json(json.dumps(line["prefill"])),
        decode=RequestResult.from_json(json.dumps(line["decode"])),
    )
