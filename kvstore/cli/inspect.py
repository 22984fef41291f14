"""``kvstore inspect``: what a data dir holds, offline and read-only (safe next to a live store), or what a running
server holds (``--url``, ``kvstore.cli.online``); both with the top documents by hits (``kvstore.cli.top_documents``:
offline, the counts the last server saved in the data dir).

A data dir a running ``kvstore serve`` holds (its ``serve.json`` names a live process, as an engine's embedded
server's does) is shown by asking that server, as ``--url`` would (``--offline`` reads the files instead). The
store, LMDB and the client are imported only after the arguments are checked: a mistake is refused at once.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from kvstore.cli.quantities import count_text, size_text
from kvstore.cli.server_probe import check_listening
from kvstore.config import DEFAULT_DATA_DIR
from kvstore.data_dir.server_record import live_server_record
from kvstore.errors import ConfigError, StorageError

if TYPE_CHECKING:
    from rich.console import Console

    from kvstore.store.inspection import DataDirSummary

__all__ = ["MAX_TOP_DOCUMENTS", "inspect_command", "render_summary"]

MAX_TOP_DOCUMENTS = 1000
"""``--top``'s bound: ``kvstore.wire.documents.MAX_TOP_DOCUMENTS`` (what a server answers), here without the wire's
imports (``tests/cli/test_refusals.py`` checks they agree)."""

_KVSTORE_FILES = ("serve.json", "document-hits.msgpack", "LOCK")
"""Files kvstore writes into a data dir besides ``data.mdb``: a dir with some of them but no ``data.mdb`` was used
by a server that never stored anything."""


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
    offline: bool = typer.Option(
        False, "--offline", help="Read the data dir's files even when a running server holds it (default: ask it)."
    ),
) -> None:
    """Summarise a data dir (chunks, bytes, compression ratio, layout, oldest/newest access) or a running server.

    Both come with the top documents by hits (a document: the chunks one store added; hits: lookups that reused it).
    A data dir a running server holds (an engine's embedded server's too: its URL is in DIR/serve.json) is shown
    by asking that server, unless --offline or --check.

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
        if offline:
            raise ConfigError("--offline reads a data dir's files; drop --url (or --offline)")
        _ask_server(url, key, as_json, top)
        return
    path = data_dir if data_dir is not None else DEFAULT_DATA_DIR
    holder = live_server_record(path)
    if holder is not None and not (check or offline):
        typer.echo(f"kvstore inspect: {path} is held by kvstore serve (pid {holder.pid}); asking it at {holder.url}",
                   err=True)  # fmt: skip
        _ask_server(holder.url, key, as_json, top)
        return
    if key is not None:
        from kvstore.keys import key_from_hex

        key_from_hex(key)  # a malformed key is the mistake to name, whatever the data dir
    _check_is_data_dir(path)
    if check:
        _check(path, as_json)
        return
    _inspect_offline(path, key, as_json, top)


def _ask_server(url: str, key: str | None, as_json: bool, top: int) -> None:
    check_listening(url)
    from kvstore.cli.online import inspect_server

    inspect_server(url, key, as_json, top)


def _check_is_data_dir(path: Path) -> None:
    """Refuse a path with no ``data.mdb`` before LMDB is imported, saying what the path is instead."""
    if (path / "data.mdb").is_file():
        return
    if not path.exists():
        raise StorageError(f"{path} is not a kvstore data dir (it does not exist); pass the --data-dir a store used")
    if not path.is_dir():
        raise StorageError(f"{path} is not a kvstore data dir (not a directory); pass the --data-dir a store used")
    found = [name for name in _KVSTORE_FILES if (path / name).exists()]
    if found:
        raise StorageError(
            f"{path} holds no KV yet (no data.mdb, only {', '.join(found)}): a server used it but never opened it, "
            "which happens when no client named a layout; store something through a server, or start one with "
            "--layout"
        )
    raise StorageError(f"{path} is not a kvstore data dir (no data.mdb); pass the --data-dir a store used")


def _inspect_offline(path: Path, key: str | None, as_json: bool, top: int) -> None:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from kvstore.cli.top_documents import render_top_documents, saved_top_documents
    from kvstore.keys import key_from_hex
    from kvstore.store.inspection import find_chunk, summarize_data_dir

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
    # The progress goes to stderr: on stdout its transient line left a blank line before an error.
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(f"scanning {path}", total=None)
        summary = summarize_data_dir(path, lambda seen, total: progress.update(task, completed=seen, total=total))
    render_summary(console, summary)
    render_top_documents(console, saved_top_documents(path, top), offline=True)


def render_summary(console: Console, summary: DataDirSummary) -> None:
    """Print a summary as a table (shared with ``kvstore demo``)."""
    from rich.table import Table

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
    from rich.console import Console
    from rich.progress import Progress

    from kvstore.store.inspection import check_data_dir

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
