"""``kvstore bench remote``: the remote tier and fleet directory against a real Valkey, each figure with its
same-run baseline (raw SET/GET, a loopback round trip) or LMCache's published one.

The options are checked before the benchmark's modules (torch, LMDB, redis) are imported: a bad one is refused in a
fraction of a second.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.progress import Progress

from kvstore.bench.option_checks import check_preset_names
from kvstore.errors import ConfigError

if TYPE_CHECKING:
    from kvstore.bench.remote_directory import DirectoryRow
    from kvstore.bench.remote_fleet import FleetRow
    from kvstore.bench.remote_throughput import ThroughputRow

    _Row = ThroughputRow | DirectoryRow | FleetRow

__all__ = ["bench_remote_command"]

_PARTS = ("throughput", "directory", "fleet")


def bench_remote_command(
    as_json: bool = typer.Option(False, "--json", help="One JSON object per figure on stdout."),
    parts: str = typer.Option(",".join(_PARTS), "--parts", help="Which of throughput,directory,fleet to run."),
    remote_url: str | None = typer.Option(
        None, "--remote-url", help="An existing Valkey to measure (default: start one; the fleet part needs that)."
    ),
    layouts: str = typer.Option("smollm2-135m", "--layouts", help="Layout presets of the throughput part."),
    chunks: int = typer.Option(1_000_000, "--chunks", help="Chunks in the fleet directory."),
    throughput_chunks: int = typer.Option(24, "--throughput-chunks", help="Chunks per throughput repeat."),
    repeats: int = typer.Option(6, "--repeats", help="Throughput repeats (median)."),
    hosts: int = typer.Option(4, "--hosts", help="kvstore serve hosts of the fleet part."),
    run_s: float = typer.Option(9.0, "--run-s", help="Seconds of the fleet part's load (Valkey down for a third)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the token ids and KV."),
) -> None:
    """Remote tier put/get vs raw SET/GET, fleet lookup at 1M chunks, and kvstore serve hosts sharing one Valkey
    (bit-identical serving, 0 failed requests with Valkey killed mid-run).

    Examples:

        kvstore bench remote --json

        kvstore bench remote --parts directory --chunks 220000
    """
    wanted = [part.strip() for part in parts.split(",") if part.strip()]
    unknown = sorted(set(wanted) - set(_PARTS))
    if unknown or not wanted:
        raise ConfigError(f"--parts {parts!r}: choose from {','.join(_PARTS)}")
    if remote_url is not None and "fleet" in wanted:
        raise ConfigError("the fleet part kills and restarts its Valkey: run it without --remote-url")
    if hosts < 2 or run_s <= 0 or chunks < 60 or throughput_chunks < 1 or repeats < 1:
        raise ConfigError("--hosts needs 2 or more, --run-s a positive time, --chunks 60 or more, --repeats 1 or more")
    names = [name.strip() for name in layouts.split(",") if name.strip()]
    check_preset_names(names)
    # torch, LMDB and redis: only once every option is checked
    from kvstore.bench.remote_directory import run_directory
    from kvstore.bench.remote_fleet import run_fleet
    from kvstore.bench.remote_throughput import run_throughput
    from kvstore.bench.valkey_server import ValkeyServer
    from kvstore.presets import preset_layout

    rows: list[_Row] = []

    def emit(row: _Row) -> None:
        rows.append(row)
        if as_json:
            typer.echo(json.dumps(dataclasses.asdict(row)))

    console = Console(stderr=True)
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-remote-") as scratch:
        directory = Path(scratch)
        with ValkeyServer(directory / "valkey") if remote_url is None else _External(remote_url) as valkey:
            url = valkey.url
            if "throughput" in wanted:
                for name in names:
                    with console.status(f"throughput: {name}"):
                        layout = preset_layout(name)
                        measured = run_throughput(
                            url, name, layout, 256, num_chunks=throughput_chunks, repeats=repeats, seed=seed
                        )
                        for figure in measured:
                            emit(figure)
            if "directory" in wanted:
                with Progress(console=console, transient=True) as progress:
                    task = progress.add_task("directory: publishing", total=chunks)
                    emit(run_directory(url, preset_layout("smollm2-135m"), num_chunks=chunks, seed=seed,
                                       progress=lambda done, _: progress.update(task, completed=done)))  # fmt: skip
            if "fleet" in wanted:
                assert isinstance(valkey, ValkeyServer)
                with console.status(f"fleet: {hosts} kvstore serve hosts"):
                    layout = preset_layout("smollm2-135m")
                    emit(run_fleet(valkey, layout, 256, directory, num_hosts=hosts, run_s=run_s, seed=seed))
    if not as_json:
        for row in rows:
            typer.echo(", ".join(f"{key}={value}" for key, value in dataclasses.asdict(row).items()))


class _External:
    """An existing remote named by ``--remote-url`` (a context manager like ``ValkeyServer``)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def __enter__(self) -> _External:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None
