"""``kvstore inspect``: what a data dir holds, offline and read-only (safe next to a live store), or what a running
server holds (``--url``, ``kvstore.cli.online``); both with the top documents by hits (``kvstore.cli.top_documents``:
offline, the counts the last server saved in the data dir)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvstore.cli.online import inspect_server
from kvstore.cli.quantities import count_text, size_text
from kvstore.cli.top_documents import render_top_documents, saved_top_documents
from kvstore.config import DEFAULT_DATA_DIR
from kvstore.errors import ConfigError
from kvstore.keys import key_from_hex
from kvstore.store.inspection import DataDirSummary, check_data_dir, find_chunk, summarize_data_dir
from kvstore.wire.documents import MAX_TOP_DOCUMENTS

__all__ = ["inspect_command", "render_summary"]


def inspect_command(
    data_dir: Path | None = typer.Option(
        None, "--data-dir", help="The data dir (holds data.mdb; default: ./kvstore-data)."
    ),
    key: str | None = typer.Option(None, "--key", help="Show one chunk by its 32-hex-digit key."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
    check: bool = typer.Option(False, "--check", help="Decode every frame and report defects; exit 1 on any."),
    url: str | None = typer.Option(
        None, "--url", help="A running server (tcp://host:port): live tiers, hit rates, clients, top documents."
    ),
    top: int = typer.Option(
        10, "--top", min=1, max=MAX_TOP_DOCUMENTS, help="How many of the most-hit documents to show."
    ),
) -> None:
    """Summarise a data dir (chunks, bytes, compression ratio, layout, oldest/newest access) or a running server.

    Both come with the top documents by hits (a document: the chunks one store added; hits: lookups that reused it).

    Examples:

        kvstore inspect --data-dir ./kvstore-data

        kvstore inspect --data-dir ./kvstore-data --json

        kvstore inspect --key 288dbd46d2eda1e6f6a95d9411f8f6cc

        kvstore inspect --data-dir ./kvstore-data --check

        kvstore inspect --url tcp://127.0.0.1:5555 --top 20 --json
    """
    if url is not None:
        if data_dir is not None:  # it was ignored: the server's own data dir is what --url shows
            raise ConfigError("--url inspects a running server, --data-dir a data dir offline: give one of them")
        if check:
            raise ConfigError("--check walks a data dir offline; drop --url (or --check)")
        inspect_server(url, key, as_json, top)
        return
    path = data_dir if data_dir is not None else DEFAULT_DATA_DIR
    if check:
        _check(path, as_json)
        return
    if key is not None:
        chunk = find_chunk(path, key_from_hex(key))
        if chunk is None:
            typer.echo(f"kvstore: error: no chunk {key} in {path}", err=True)
            raise typer.Exit(1)
        if as_json:
            typer.echo(json.dumps(chunk.to_json_dict()))
        else:
            table = Table(title=f"chunk {chunk.key}", show_header=False)
            for name, value in chunk.to_json_dict().items():
                table.add_row(name, str(value))
            Console().print(table)
        return
    if as_json:
        summary = summarize_data_dir(path)
        typer.echo(json.dumps(summary.to_json_dict() | saved_top_documents(path, top).to_json_dict()))
        return
    console = Console(width=max(120, shutil.get_terminal_size().columns))  # the top documents' 32-digit keys
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"scanning {path}", total=None)
        summary = summarize_data_dir(path, lambda seen, total: progress.update(task, completed=seen, total=total))
    render_summary(console, summary)
    render_top_documents(console, saved_top_documents(path, top), offline=True)


def render_summary(console: Console, summary: DataDirSummary) -> None:
    """Print a summary as a table (shared with ``kvstore demo``)."""
    table = Table(title=f"kvstore data dir {summary.path}", show_header=False)
    rows = [
        ("layout", f"{summary.layout}"),
        ("namespace", summary.layout_namespace),
        ("chunk size", f"{summary.chunk_size} tokens"),
        ("chunks (disk tier)", f"{summary.num_chunks:,} ({summary.num_partial_chunks:,} partial)"),
        ("sequences (chunks at position 0)", f"{summary.num_sequences:,}"),
        ("tokens", f"{summary.num_tokens:,}"),
        ("KV bytes (raw)", size_text(summary.raw_bytes)),
        ("stored bytes", f"{size_text(summary.stored_bytes)} of {size_text(summary.capacity_bytes)} cap"),
        ("compression ratio", f"{summary.compression_ratio:.3f}"),
        ("data.mdb size", size_text(summary.file_bytes)),
        ("oldest access", summary.oldest_access or "-"),
        ("newest access", summary.newest_access or "-"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)


def _check(path: Path, as_json: bool) -> None:
    with Progress(console=Console(stderr=True), transient=True, disable=as_json) as progress:
        task = progress.add_task(f"checking {path}", total=None)
        report = check_data_dir(path, lambda checked: progress.update(task, completed=checked))
    if as_json:
        typer.echo(json.dumps({name: getattr(report, name) for name in report.__slots__} | {"ok": report.ok}))
    else:
        typer.echo(
            f"checked {count_text(report.num_chunks, 'chunk')}, {count_text(report.num_frames, 'frame')} "
            f"({report.num_unfinished_frames:,} of unfinished writes): "
            + ("no problems" if report.ok else count_text(report.num_problems, "problem"))
        )
        for problem in report.problems:
            typer.echo(f"  {problem}")
    if not report.ok:
        raise typer.Exit(1)
