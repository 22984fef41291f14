"""``kvstore bench server``: lookup latency and shared-memory bandwidth through a real server vs in process."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from kvstore.bench.server_options import ServerBenchOptions
from kvstore.chunking import parse_chunking

if TYPE_CHECKING:
    from kvstore.bench.server import ServerBenchRow

__all__ = ["bench_server_command"]

_DEFAULTS = ServerBenchOptions()


def bench_server_command(
    as_json: bool = typer.Option(False, "--json", help="One JSON object per figure on stdout."),
    lookup_tokens: int = typer.Option(_DEFAULTS.lookup_tokens, "--lookup-tokens", help="Prompt length to plan."),
    lookups: int = typer.Option(_DEFAULTS.num_lookups, "--lookups", help="Timed lookups per side."),
    lookup_layout: str = typer.Option(_DEFAULTS.lookup_layout, "--lookup-layout", help="Layout preset (lookups)."),
    bulk_tokens: int = typer.Option(_DEFAULTS.bulk_tokens, "--bulk-tokens", help="Tokens per store/retrieve."),
    bulk_layout: str = typer.Option(_DEFAULTS.bulk_layout, "--bulk-layout", help="Layout preset (bandwidth)."),
    repeats: int = typer.Option(_DEFAULTS.num_repeats, "--repeats", help="Timed bandwidth repeats per side."),
    chunk_size: int = typer.Option(_DEFAULTS.chunk_size, "--chunk-size", help="Tokens per chunk."),
    chunking: str = typer.Option(
        _DEFAULTS.chunking.value, "--chunking", help="The stores' cut rule: fixed or content (chunk size: the longest)."
    ),
    seed: int = typer.Option(_DEFAULTS.seed, "--seed", help="Seed of the token ids and KV."),
    kv_events: bool = typer.Option(
        False, "--kv-events", help="The servers publish KV events (compare with a run without: their cost)."
    ),
) -> None:
    """Lookup latency of a 15k-token prompt over loopback, and store/retrieve GB/s of 8B-shaped chunks through
    shared memory, each against the in-process TieredStore in the same run (servers: tiers cpu).

    Examples:

        kvstore bench server --json

        kvstore bench server --lookups 1000 --repeats 10

        kvstore bench server --json --kv-events

        kvstore bench server --json --chunking content
    """
    options = ServerBenchOptions(
        lookup_layout=lookup_layout,
        bulk_layout=bulk_layout,
        lookup_tokens=lookup_tokens,
        num_lookups=lookups,
        bulk_tokens=bulk_tokens,
        num_repeats=repeats,
        chunk_size=chunk_size,
        chunking=parse_chunking(chunking),
        seed=seed,
        kv_events=kv_events,
    )
    from kvstore.bench.server import run_server_benchmark  # torch and the store: after the options' checks

    rows: list[ServerBenchRow] = []
    with (
        tempfile.TemporaryDirectory(prefix="kvstore-bench-server-") as directory,
        Console(stderr=True).status("kvstore bench server") as status,
    ):
        for row in run_server_benchmark(options, Path(directory), lambda message: status.update(message)):
            rows.append(row)
            if as_json:
                typer.echo(json.dumps(row.to_json_dict()))
    if not as_json:
        _render(rows)


def _render(rows: list[ServerBenchRow]) -> None:
    table = Table(title="kvstore bench server (server vs in-process TieredStore, same run)")
    for column in ("op", "variant", "tokens", "value", "in-process", "ratio", "target", "met", "p50 ms", "p99 ms"):
        table.add_column(column)
    for row in rows:
        target = f"p50 <= {row.target:g} ms" if row.unit == "ms" else f">= {row.target:g}x"
        table.add_row(
            row.op, row.variant, f"{row.num_tokens:,}", f"{row.value:.3f} {row.unit}",
            f"{row.baseline_value:.3f} {row.unit}", f"{row.ratio:.2f}", target, "yes" if row.met else "[red]no[/red]",
            f"{row.p50_ms:.3f}", f"{row.p99_ms:.3f}",
        )  # fmt: skip
    Console(width=160).print(table)
    for row in rows:
        typer.echo(f"{row.op} ({row.variant}): {row.note}")
