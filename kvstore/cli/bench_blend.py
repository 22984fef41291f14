"""``kvstore bench multi-doc-qa`` and ``kvstore bench shuffle``: blended prefill against full and prefix prefill.

The options are declared once, in ``kvstore.cli.bench_multidoc_options``; the options dataclasses they fill
(``kvstore.bench.multidoc_options``, the blend settings of ``kvstore.blend.config``) are checked before the benchmark,
torch and the models are imported: a bad one is refused in a fraction of a second.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvstore.bench.multidoc_options import BenchMode, BenchWorkload, FactStyle, MultiDocOptions, WarmUp
from kvstore.blend.config import AttentionKernel, BlendConfig, DeviationMetric
from kvstore.cli.bench_multidoc_options import MULTIDOC_OPTIONS
from kvstore.cli.declared_options import GivenValues, declared_command
from kvstore.config import parse_size, parse_tiers
from kvstore.errors import ConfigError

if TYPE_CHECKING:
    from kvstore.bench.multidoc_rows import MultiDocRow

__all__ = ["multi_doc_qa_command", "shuffle_command"]

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


def _options(workload: BenchWorkload, given: GivenValues) -> MultiDocOptions:
    """The run's options, each parsed and checked (``BlendConfig`` checks every blend setting) before the model
    loads."""
    try:
        deviation_metric = DeviationMetric(given["deviation"])
    except ValueError:
        raise ConfigError(f"--deviation {given['deviation']!r}: use key, value or key_value") from None
    cpu_capacity, gpu_capacity = given["cpu_capacity"], given["gpu_capacity"]
    return given.build(
        MultiDocOptions,
        workload=workload,
        tiers=parse_tiers(given["tiers"]),
        warm_up=_parse_warm_up(given["warm_up"]),
        facts=_parse_facts(given["facts"]),
        cpu_capacity_bytes=parse_size(cpu_capacity) if cpu_capacity else None,
        gpu_capacity_bytes=parse_size(gpu_capacity) if gpu_capacity else None,
        blend=given.build(BlendConfig, deviation=deviation_metric, attention=_attention_kernel(given["attention"])),
        modes=_parse_modes(given["modes"]),
    )


def _run(workload: BenchWorkload, given: GivenValues) -> None:
    """Check the options, run the benchmark with a progress bar, print its rows, and hold blend to
    ``--expected-ttft-gain``."""
    options = _options(workload, given)
    from kvstore.bench.multidoc import run_multidoc_benchmark
    from kvstore.models import default_model_cache_dir

    options = dataclasses.replace(options, model_cache_dir=default_model_cache_dir(os.environ))
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(f"kvstore bench {workload.value.replace('_', '-')}", total=None)

        def show(step: str, done: int, total: int) -> None:
            progress.update(task, description=step, completed=done, total=total)

        rows = run_multidoc_benchmark(options, show)
    if given.switch("as_json"):
        for row in rows:
            typer.echo(json.dumps(row.to_json_dict()))
    else:
        _render(rows)
    expected_ttft_gain = given["expected_ttft_gain"]
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


def _command(workload: BenchWorkload) -> Callable[..., None]:
    return declared_command(MULTIDOC_OPTIONS, functools.partial(_run, workload), _HELP[workload])


multi_doc_qa_command = _command(BenchWorkload.MULTI_DOC_QA)
shuffle_command = _command(BenchWorkload.SHUFFLE)
