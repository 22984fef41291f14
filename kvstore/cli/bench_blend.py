"""``kvstore bench multi-doc-qa`` and ``kvstore bench shuffle``: blended prefill against full and prefix prefill.

The options (``kvstore.bench.multidoc_options``, the blend settings of ``kvstore.blend.config``) are checked before
the benchmark, torch and the models are imported: a bad one is refused in a fraction of a second.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvstore.bench.multidoc_options import BenchMode, BenchWorkload, FactStyle, MultiDocOptions, WarmUp
from kvstore.blend.config import AttentionKernel, BlendConfig, DeviationMetric, SelectionPolicy
from kvstore.config import parse_size, parse_tiers
from kvstore.errors import ConfigError
from kvstore.models.random_init_names import RANDOM_INIT_PRESETS

if TYPE_CHECKING:
    from kvstore.bench.multidoc_rows import MultiDocRow

__all__ = ["multi_doc_qa_command", "shuffle_command"]

_DEFAULTS = MultiDocOptions()

_HELP = {
    BenchWorkload.MULTI_DOC_QA: """TTFT and quality of full, prefix, blend and reuse prefill on multi-document QA.

    Warm-up stores each document after the system preamble (--warm-up alone: from position 0; --warm-up grouped:
    --docs-per-query documents per prompt, as earlier requests would have stored them); queries combine
    random documents in random order, each asking about one planted fact. Fact accuracy comes with its 95% interval
    and the paired difference with full prefill on the same queries.

    Examples:

        kvstore bench multi-doc-qa --json

        kvstore bench multi-doc-qa --random-init llama3.1-8b --device cuda --dtype bfloat16 --tiers cpu \\
            --num-documents 5 --document-tokens 3000 --docs-per-query 5 --expected-ttft-gain 3.3 --json
    """,
    BenchWorkload.SHUFFLE: """TTFT and quality of full, prefix, blend and reuse prefill when every document moves.

    Warm-up stores all documents in their original order once; queries are derangements (no document keeps its
    slot).

    Examples:

        kvstore bench shuffle --num-documents 5 --json

        kvstore bench shuffle --random-init tiny-llama --document-tokens 64 --num-queries 4 --json
    """,
}


def _attention_kernel(text: str) -> AttentionKernel:
    try:
        return AttentionKernel(text)
    except ValueError:
        raise ConfigError(f"--attention {text!r}: use sdpa, flex or auto") from None


def _parse_modes(text: str) -> tuple[BenchMode, ...]:
    try:
        return tuple(BenchMode(part.strip()) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(
            f"--modes {text!r}: each mode must be one of {', '.join(mode.value for mode in BenchMode)}"
        ) from None


def _parse_warm_up(text: str) -> WarmUp:
    try:
        return WarmUp(text)
    except ValueError:
        raise ConfigError(f"--warm-up {text!r}: use preamble, alone or grouped") from None


def _parse_facts(text: str) -> FactStyle:
    try:
        return FactStyle(text)
    except ValueError:
        raise ConfigError(f"--facts {text!r}: use distinct or same") from None


def _render(rows: list[MultiDocRow]) -> None:
    table = Table(title=f"kvstore bench {rows[0].bench.replace('_', '-')} ({rows[0].model}, {rows[0].device})")
    for column in ("mode", "ratio", "TTFT mean ms", "p50", "p99", "speedup", "lookup", "load", "recompute",
                   "other", "recomputed tok", "top-1", "KL", "cont. match", "fact acc.", "fact vs full (95% CI)",
                   "full only / mode only"):  # fmt: skip
        table.add_column(column)

    def show(value: float | None, digits: int = 3) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    def difference(row: MultiDocRow) -> str:
        if row.fact_difference_vs_full is None:
            return "-"
        return (f"{row.fact_difference_vs_full:+.3f} ({row.fact_difference_ci95_low:+.3f}, "
                f"{row.fact_difference_ci95_high:+.3f})")  # fmt: skip

    def discordant(row: MultiDocRow) -> str:
        return "-" if row.fact_full_only is None else f"{row.fact_full_only} / {row.fact_mode_only}"

    for row in rows:
        table.add_row(
            row.mode, show(row.recompute_ratio, 2), show(row.ttft_ms_mean, 1), show(row.ttft_ms_p50, 1),
            show(row.ttft_ms_p99, 1), show(row.speedup_vs_full, 2), show(row.lookup_ms_mean, 1),
            show(row.load_ms_mean, 1), show(row.recompute_ms_mean, 1), show(row.other_ms_mean, 1),
            show(row.recomputed_tokens_mean, 0), show(row.top1_agreement), show(row.kl_mean, 4),
            show(row.continuation_match), show(row.fact_accuracy), difference(row), discordant(row),
        )  # fmt: skip
    Console(width=220).print(table)


def _command(workload: BenchWorkload) -> Callable[..., None]:
    def command(
        as_json: bool = typer.Option(False, "--json", help="One JSON object per mode on stdout."),
        model_path: Path | None = typer.Option(
            None, "--model", help="A local Llama-family Hugging Face directory (default: SmolLM2-135M-Instruct)."
        ),
        random_init: str | None = typer.Option(
            None, "--random-init", help=f"A random model of a real shape: {', '.join(RANDOM_INIT_PRESETS)}."
        ),
        num_layers: int | None = typer.Option(None, "--num-layers", help="Depth override of --random-init."),
        device: str = typer.Option("auto", "--device", help="cpu, cuda, cuda:N, or auto."),
        dtype: str = typer.Option("auto", "--dtype", help="float32, bfloat16, float16, or auto (bf16 on CUDA)."),
        tiers: str = typer.Option("cpu", "--tiers", help="Store tiers holding the cached KV, e.g. gpu / cpu,disk."),
        data_dir: Path | None = typer.Option(None, "--data-dir", help="Disk tier data dir (default: a temp dir)."),
        chunk_size: int = typer.Option(_DEFAULTS.chunk_size, "--chunk-size", help="Tokens per stored chunk."),
        warm_up: str = typer.Option(
            _DEFAULTS.warm_up.value,
            "--warm-up",
            help="multi-doc-qa: store documents after the 'preamble', 'alone', or --docs-per-query at a time "
            "('grouped').",
        ),
        facts: str = typer.Option(
            _DEFAULTS.facts.value,
            "--facts",
            help="Planted facts: 'distinct' relations per document, or the 'same' sentence in each (binding test).",
        ),
        cpu_capacity: str | None = typer.Option(
            None, "--cpu-size", help="cpu tier size (default: twice the documents' KV, at least 64MiB)."
        ),
        gpu_capacity: str | None = typer.Option(
            None, "--gpu-size", help="gpu tier size (default: twice the documents' KV, at least 64MiB)."
        ),
        num_documents: int = typer.Option(_DEFAULTS.num_documents, "--num-documents", help="Documents stored."),
        document_tokens: int = typer.Option(_DEFAULTS.document_tokens, "--document-tokens", help="Tokens each."),
        num_queries: int = typer.Option(_DEFAULTS.num_queries, "--num-queries", help="Timed queries."),
        docs_per_query: int = typer.Option(
            _DEFAULTS.docs_per_query, "--docs-per-query", help="Documents per query (multi-doc-qa)."
        ),
        recompute_ratio: float = typer.Option(
            _DEFAULTS.blend.recompute_ratio, "--recompute-ratio", help="Blend ratio."
        ),
        check_layer: int = typer.Option(_DEFAULTS.blend.check_layer, "--check-layer", help="Blend check layer."),
        selection: str = typer.Option(
            _DEFAULTS.blend.selection.value,
            "--selection",
            help="Blend: how the ratio's tokens are chosen: "
            + ", ".join(policy.value for policy in SelectionPolicy)
            + ".",
        ),
        chunk_start_tokens: int = typer.Option(
            _DEFAULTS.blend.chunk_start_tokens,
            "--chunk-start-tokens",
            help="Blend: first tokens of every reused span the chunk_start policies take (within the ratio).",
        ),
        deviation: str = typer.Option(
            "key", "--deviation", help="What kv_deviation compares: 'key', 'value' or 'key_value'."
        ),
        attention: str = typer.Option(
            "auto", "--attention", help="Attention of the recomputed tokens: 'sdpa', 'flex' or 'auto' (flex on CUDA)."
        ),
        num_head_tokens: int = typer.Option(
            _DEFAULTS.blend.num_head_tokens,
            "--num-head-tokens",
            help="Blend: also recompute the first N tokens of every reused span (on top of the ratio).",
        ),
        recurring_context_tokens: int = typer.Option(
            _DEFAULTS.blend.recurring_context_tokens,
            "--recurring-context-tokens",
            help="Blend: also recompute reused tokens whose last N tokens occur earlier in the prompt (0: off).",
        ),
        stale_key_scale: float = typer.Option(
            _DEFAULTS.blend.stale_key_scale,
            "--stale-key-scale",
            help="Blend: scale the keys of cached tokens kept after the check layer, in (0, 1] (1.0: off).",
        ),
        disk_policy: str = typer.Option(
            _DEFAULTS.blend.disk_policy.value,
            "--disk-policy",
            help="Blend: chunks only the disk holds: 'auto' (recompute when faster), 'wait' or 'recompute'.",
        ),
        modes: str = typer.Option("full,prefix,blend,reuse", "--modes", help="Modes to run (full always runs)."),
        continuation_tokens: int = typer.Option(32, "--continuation-tokens", help="Greedy tokens compared."),
        seed: int = typer.Option(_DEFAULTS.seed, "--seed", help="Seed of documents, facts, queries, weights."),
        samples_path: Path | None = typer.Option(
            None, "--samples", help="Also write one JSON line per query and mode to this file, as they come."
        ),
        expected_ttft_gain: float | None = typer.Option(
            None, "--expected-ttft-gain", help="Exit 1 when blend's speedup over full is below this."
        ),
    ) -> None:
        try:
            deviation_metric = DeviationMetric(deviation)
        except ValueError:
            raise ConfigError(f"--deviation {deviation!r}: use key, value or key_value") from None
        options = MultiDocOptions(
            workload=workload,
            model_path=model_path,
            random_init=random_init,
            num_layers=num_layers,
            device=device,
            dtype=dtype,
            tiers=parse_tiers(tiers),
            data_dir=data_dir,
            chunk_size=chunk_size,
            warm_up=_parse_warm_up(warm_up),
            facts=_parse_facts(facts),
            cpu_capacity_bytes=parse_size(cpu_capacity) if cpu_capacity else None,
            gpu_capacity_bytes=parse_size(gpu_capacity) if gpu_capacity else None,
            num_documents=num_documents,
            document_tokens=document_tokens,
            num_queries=num_queries,
            docs_per_query=docs_per_query,
            blend=BlendConfig(  # checks every setting before the model loads
                recompute_ratio=recompute_ratio,
                check_layer=check_layer,
                selection=selection,  # type: ignore[arg-type]  # BlendConfig checks it
                deviation=deviation_metric,
                chunk_start_tokens=chunk_start_tokens,
                attention=_attention_kernel(attention),
                num_head_tokens=num_head_tokens,
                recurring_context_tokens=recurring_context_tokens,
                stale_key_scale=stale_key_scale,
                disk_policy=disk_policy,  # type: ignore[arg-type]  # BlendConfig checks it
            ),
            modes=_parse_modes(modes),
            continuation_tokens=continuation_tokens,
            seed=seed,
            samples_path=samples_path,
        )
        from kvstore.bench.multidoc import run_multidoc_benchmark
        from kvstore.models import default_model_cache_dir

        options = dataclasses.replace(options, model_cache_dir=default_model_cache_dir(os.environ))
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
            task = progress.add_task(f"kvstore bench {workload.value.replace('_', '-')}", total=None)

            def show(step: str, done: int, total: int) -> None:
                progress.update(task, description=step, completed=done, total=total)

            rows = run_multidoc_benchmark(options, show)
        if as_json:
            for row in rows:
                typer.echo(json.dumps(row.to_json_dict()))
        else:
            _render(rows)
        blend = next((row for row in rows if row.mode == BenchMode.BLEND.value), None)
        if expected_ttft_gain is not None:
            if blend is None:
                raise ConfigError("--expected-ttft-gain needs the blend mode in --modes")
            if blend.speedup_vs_full < expected_ttft_gain:
                typer.echo(
                    f"kvstore: error: blend TTFT speedup {blend.speedup_vs_full:.2f}x over full prefill is below "
                    f"--expected-ttft-gain {expected_ttft_gain:g}",
                    err=True,
                )
                raise typer.Exit(1)

    command.__doc__ = _HELP[workload]
    return command


multi_doc_qa_command = _command(BenchWorkload.MULTI_DOC_QA)
shuffle_command = _command(BenchWorkload.SHUFFLE)
