"""``kvstore bench tiers``, ``index`` and ``rebuild``: the store's own benchmarks, each figure against a baseline
measured in the same run.

Each command checks its options (``kvstore.bench.*_options``, torch-free) before it imports its benchmark, which
imports torch, numba or LMDB: a bad option is refused in a fraction of a second.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvstore.bench.rebuild_options import RebuildBenchOptions, default_data_dir
from kvstore.bench.tier_options import TierBenchOptions
from kvstore.config import parse_size, parse_tiers
from kvstore.errors import ConfigError
from kvstore.preset_names import PRESET_NAMES

if TYPE_CHECKING:
    from kvstore.bench.tiers import TierBenchRow

__all__ = ["bench_index_command", "bench_rebuild_command", "bench_tiers_command"]

_DEFAULTS = TierBenchOptions()


def bench_tiers_command(
    as_json: bool = typer.Option(False, "--json", help="One JSON object per (tier, layout, op) on stdout."),
    tiers: str = typer.Option("gpu,cpu,disk", "--tiers", help="Tiers to measure (gpu is skipped without CUDA)."),
    layouts: str = typer.Option(",".join(PRESET_NAMES), "--layouts", help="Layout presets, comma-separated."),
    memory_size: str = typer.Option("512MiB", "--cpu-size", help="cpu tier size: KV bytes per repeat."),
    gpu_memory_size: str = typer.Option("2GiB", "--gpu-size", help="gpu tier size: KV bytes per repeat."),
    disk_size: str = typer.Option("768MiB", "--disk-size", help="disk KV bytes written and read per repeat."),
    repeats: int = typer.Option(_DEFAULTS.num_repeats, "--repeats", help="Timed repeats of cpu/gpu ops."),
    disk_repeats: int = typer.Option(_DEFAULTS.num_disk_repeats, "--disk-repeats", help="Timed disk repeats."),
    directory: Path | None = typer.Option(
        None, "--scratch-dir", help="Where the temporary data dir is made (default: the system's temp dir)."
    ),
    device: str = typer.Option("cuda", "--device", help="cuda, cuda:N, or cpu (runs the gpu-tier logic on host)."),
    chunk_size: int = typer.Option(_DEFAULTS.chunk_size, "--chunk-size", help="Tokens per chunk."),
    zstd_level: int = typer.Option(_DEFAULTS.zstd_level, "--zstd-level", help="Disk codec zstd level."),
    codec_threads: int = typer.Option(_DEFAULTS.num_codec_threads, "--codec-threads", help="Disk codec threads."),
    seed: int = typer.Option(_DEFAULTS.seed, "--seed", help="Seed of the random KV and token ids."),
) -> None:
    """Put/get GB/s of each tier for SmolLM2-135M and Llama-3.1-8B-shaped chunks vs memcpy / raw disk.

    Examples:

        kvstore bench tiers

        kvstore bench tiers --json --tiers cpu,disk --disk-size 256MiB
    """
    options = TierBenchOptions(
        layouts=tuple(name.strip() for name in layouts.split(",") if name.strip()),
        tiers=parse_tiers(tiers),
        memory_bytes=parse_size(memory_size),
        gpu_memory_bytes=parse_size(gpu_memory_size),
        disk_bytes=parse_size(disk_size),
        num_repeats=repeats,
        num_disk_repeats=disk_repeats,
        directory=directory,
        device=device,
        chunk_size=chunk_size,
        zstd_level=zstd_level,
        num_codec_threads=codec_threads,
        seed=seed,
    )
    from kvstore.bench.tiers import run_tier_benchmark

    console = Console(stderr=True)
    rows: list[TierBenchRow] = []
    with console.status("benchmarking tiers") as status:
        for row in run_tier_benchmark(options, progress=lambda message: status.update(message)):
            rows.append(row)
            if as_json:
                typer.echo(json.dumps(row.to_json_dict()))
    if not as_json:
        _render(Console(width=150), rows)


def _render(console: Console, rows: list[TierBenchRow]) -> None:
    table = Table(title="kvstore bench tiers (GB/s of uncompressed KV; ratio = tier / same-run baseline)")
    for column in (
        "tier",
        "layout",
        "op",
        "GB/s",
        "base GB/s",
        "ratio",
        "target",
        "met",
        "compr",
        "p50 ms",
        "p99 ms",
    ):
        table.add_column(column)
    for row in rows:
        table.add_row(
            row.tier.value,
            row.layout,
            row.op,
            f"{row.GBps:.2f}",
            f"{row.baseline_GBps:.2f}",
            f"{row.ratio:.2f}",
            f"{row.target_ratio:.2f}",
            "yes" if row.met else "[red]no[/red]",
            f"{row.compression_ratio:.2f}" if row.compression_ratio else "",
            f"{row.p50_ms:.2f}" if row.p50_ms is not None else "",
            f"{row.p99_ms:.2f}" if row.p99_ms is not None else "",
        )
    console.print(table)
    for row in rows:
        cores = ""
        if row.cpu_cores is not None and row.baseline_cpu_cores is not None:
            cores = f"; CPU cores busy {row.cpu_cores:.2f} (baseline {row.baseline_cpu_cores:.2f})"
        if row.user_core_s_per_GB is not None and row.sys_core_s_per_GB is not None:
            cores += f", user / system core-s per GB {row.user_core_s_per_GB:.2f} / {row.sys_core_s_per_GB:.2f}"
        console.print(f"{row.tier.value} {row.layout} {row.op}: baseline = {row.baseline}; {row.note}{cores}")


def bench_index_command(
    chunks: str = typer.Option("2200,220000", "--chunks", help="Comma-separated index sizes in chunks (1000000)."),
    queries: int = typer.Option(200, "--queries", help="Queries (~15K tokens each) per size."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random documents and queries."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per size on stdout."),
) -> None:
    """Recall, false positives, coverage, match latency and memory of the content fingerprint index.

    Examples:

        kvstore bench index --json

        kvstore bench index --chunks 1000000 --json
    """
    try:
        sizes = [int(text) for text in chunks.split(",") if text.strip()]
    except ValueError:
        raise ConfigError(f"--chunks {chunks!r}: give comma-separated chunk counts, e.g. 2200,220000") from None
    if not sizes or min(sizes) < 1 or queries < 1:
        raise ConfigError("--chunks needs positive chunk counts and --queries a positive number")
    from kvstore.bench.index import run_index_benchmark

    console = Console(stderr=True)
    for num_chunks in sizes:
        with console.status(f"fingerprint index: {num_chunks:,} chunks"):
            row = run_index_benchmark(num_chunks, queries, seed)
        if as_json:
            typer.echo(json.dumps(row.to_json_dict()))
        else:
            typer.echo("  ".join(f"{name}={value}" for name, value in row.to_json_dict().items()))


_REBUILD_DEFAULTS = RebuildBenchOptions()
_REBUILD_DIR_HELP = f"The data dir, kept for later runs [default: {default_data_dir(1_000_000)} for 1M chunks]."


def bench_rebuild_command(
    chunks: int = typer.Option(_REBUILD_DEFAULTS.num_chunks, "--chunks", help="Chunks in the data dir (12 a doc)."),
    directory: Path | None = typer.Option(None, "--data-dir", help=_REBUILD_DIR_HELP),
    queries: int = typer.Option(_REBUILD_DEFAULTS.num_queries, "--queries", help="Lookups that check the index."),
    repeats: int = typer.Option(_REBUILD_DEFAULTS.num_repeats, "--repeats", help="Timed opens (and baselines)."),
    head_dim: int = typer.Option(_REBUILD_DEFAULTS.head_dim, "--head-dim", help="Of the tiny KV layout (fp16)."),
    seed: int = typer.Option(_REBUILD_DEFAULTS.seed, "--seed", help="Seed of the documents and queries."),
    cold: bool = typer.Option(False, "--cold", help="Drop the data dir from the page cache before each open."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout."),
) -> None:
    """Time reopening a data dir of N chunks with blending on (the content index is rebuilt) vs reading its records.

    The data dir is built once (tiny KV, documents of 3000 tokens) and reused by later runs with the same --chunks
    and --seed.

    Examples:

        kvstore bench rebuild --chunks 100000 --json

        kvstore bench rebuild --chunks 1000000 --json
    """
    options = RebuildBenchOptions(
        num_chunks=chunks,
        data_dir=directory,
        num_queries=queries,
        num_repeats=repeats,
        head_dim=head_dim,
        seed=seed,
        cold=cold,
    )
    from kvstore.bench.rebuild import run_rebuild_benchmark

    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("kvstore bench rebuild", total=None)

        def show(step: str, done: int, total: int | None) -> None:
            progress.update(task, description=step, completed=done, total=total)

        row = run_rebuild_benchmark(options, show)
    if as_json:
        typer.echo(json.dumps(row.to_json_dict()))
    else:
        typer.echo("  ".join(f"{name}={value}" for name, value in row.to_json_dict().items()))
