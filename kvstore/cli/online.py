"""``kvstore inspect --url`` and ``kvstore evict --url``: the admin commands against a running server.

They connect as an admin client (no layout), so they work on any server, whatever model it serves. ``inspect``
shows the server's tiers (capacity, used, chunks, pinned, hit rate, evictions), its layout and features, the
clients and their open plans, the content index, the most-hit chunks and the most-hit documents (``--top``; counted
by the server from the plans it hands out, ``kvstore.server.usage.documents``); ``--key`` shows one chunk.
``evict`` drops chunks by key, frees bytes of one tier or every tier, or empties them (pinned chunks stay).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from kvstore.cli.eviction_report import echo_eviction, eviction_report
from kvstore.cli.quantities import size_text
from kvstore.cli.top_documents import TopDocuments, render_top_documents
from kvstore.client import Client
from kvstore.errors import ConfigError, ProtocolError
from kvstore.keys import PrefixKey
from kvstore.stats import StoreStats
from kvstore.tiers.base import TierName
from kvstore.wire.values import ServerInfo

__all__ = ["evict_on_server", "inspect_server"]

_EVERYTHING_BYTES = 2**62


def _connect(url: str) -> Client:
    return Client(url, None, timeout_s=30.0, connect_timeout_s=5.0, name="kvstore admin CLI")


def server_report(url: str, info: ServerInfo, stats: StoreStats) -> dict[str, object]:
    """The JSON of ``kvstore inspect --url``.

    Each tier's ``hits``, ``misses`` and ``hit_ratio`` follow ``TierStats``'s one definition of a hit: a chunk
    a lookup planned from that tier. ``lookups`` has the tokens looked up and the missed ones by reason
    (``kvstore.misses``).
    """
    tiers = []
    for tier in stats.tiers:
        row: dict[str, object] = asdict(tier)
        row["tier"] = tier.tier.value
        row["hit_ratio"] = round(tier.hit_ratio, 4)
        tiers.append(row)
    layout = info.layout
    return {
        "url": url,
        "server_version": info.server_version,
        "pid": info.pid,
        "uptime_s": round(info.uptime_s, 1),
        "layout": layout.describe() if layout is not None else None,
        "layout_namespace": layout.namespace.hex() if layout is not None else None,
        "chunk_size": info.chunk_size,
        "chunking": info.chunking.value,
        "features": asdict(info.features),
        "data_dir": info.data_dir,
        "num_requests": info.num_requests,
        "tiers": tiers,
        "num_open_plans": stats.num_open_plans,
        "num_sessions": stats.num_sessions,
        "catalog": asdict(stats.catalog) if stats.catalog is not None else None,
        "remote": asdict(stats.remote) if stats.remote is not None else None,
        "lookups": asdict(stats.lookups),
        "clients": [asdict(client) for client in info.clients],
        "top_chunks": [asdict(chunk) for chunk in info.top_chunks],
    }


def _size(num_bytes: object) -> str:
    return size_text(int(num_bytes))  # type: ignore[call-overload]


def _top_documents(client: Client, top: int) -> TopDocuments:
    """The server's most-hit documents; a server older than document counting gives a note instead."""
    try:
        report = client.documents(top)
    except ProtocolError as exc:
        return TopDocuments(documents=(), note=str(exc))
    note = None
    if report.num_dropped:
        note = (
            f"{report.num_dropped:,} less-hit documents were dropped from the counts to stay within "
            f"{report.max_documents:,} tracked documents"
        )
    return TopDocuments(documents=report.documents, note=note)


def inspect_server(url: str, key: str | None, as_json: bool, top: int = 10) -> None:
    """Print a running server's state (with its ``top`` most-hit documents), or one chunk of it."""
    with _connect(url) as client:
        if key is not None:
            chunk = client.chunk(PrefixKey(bytes.fromhex(key)))
            if as_json:
                typer.echo(json.dumps({"key": chunk.key, "tiers": [t.value for t in chunk.tiers], "hits": chunk.hits}))
            else:
                where = ", ".join(t.value for t in chunk.tiers) or "no tier (not cached)"
                typer.echo(f"chunk {chunk.key}: {where}; planned by {chunk.hits} lookups")
            if not chunk.tiers:
                raise typer.Exit(1)
            return
        report = server_report(url, client.info(), client.stats())
        documents = _top_documents(client, top)
    if as_json:
        typer.echo(json.dumps(report | documents.to_json_dict()))
        return
    console = Console(width=max(120, shutil.get_terminal_size().columns))
    _render(console, report)
    render_top_documents(console, documents, offline=False)


def _render(console: Console, report: dict[str, object]) -> None:
    summary = Table(title=f"kvstore server {report['url']}", show_header=False)
    features = report["features"]
    assert isinstance(features, dict), "server_report builds features as a dict"
    rows = [
        ("version / pid / uptime", f"{report['server_version']} / {report['pid']} / {report['uptime_s']} s"),
        ("layout", str(report["layout"] or "none registered yet")),
        ("chunk size", f"{report['chunk_size']} tokens, cut {report['chunking']}"),
        ("features", ", ".join(name for name, on in features.items() if on) or "-"),
        ("data dir", str(report["data_dir"] or "- (memory only)")),
        ("requests", f"{report['num_requests']:,}"),
        ("open plans / sessions", f"{report['num_open_plans']} / {report['num_sessions']}"),
    ]
    catalog = report["catalog"]
    if isinstance(catalog, dict):
        rows.append(
            ("content index", f"{catalog['num_entries']:,} chunks, {catalog['num_aliases']:,} aliases, "
             f"{catalog['num_strikes']:,} strikes, {catalog['num_struck_out']:,} struck out")
        )  # fmt: skip
    remote = report.get("remote")
    if isinstance(remote, dict):
        rows.append(
            ("remote", f"{'reachable' if remote['available'] else '[red]unreachable[/red]'}, {remote['outages']:,} "
             f"outages, {remote['failed_calls']:,} failed calls, {remote['directory_records']:,} directory records "
             "read")
        )  # fmt: skip
    for name, value in rows:
        summary.add_row(name, value)
    console.print(summary)
    tiers = Table(title="tiers")
    for column in ("tier", "capacity", "used", "stored", "chunks", "pinned", "hit rate", "evictions", "corrupt"):
        tiers.add_column(column)
    for row in report["tiers"]:  # type: ignore[attr-defined]
        tiers.add_row(
            row["tier"], "Valkey's" if row["tier"] == "remote" else _size(row["capacity_bytes"]),
            _size(row["used_bytes"]), _size(row["stored_bytes"]),
            f"{row['num_chunks']:,}", f"{row['num_pinned']:,}", f"{row['hit_ratio']:.1%}",
            f"{row['evictions']:,}", f"{row['corrupt_reads']:,}",
        )  # fmt: skip
    console.print(tiers)
    _render_misses(console, report["lookups"])  # type: ignore[arg-type]
    clients = Table(title="clients")
    for column in ("name", "pid", "where", "open plans", "sessions", "segments"):
        clients.add_column(column)
    for client in report["clients"]:  # type: ignore[attr-defined]
        clients.add_row(
            client["name"], str(client["pid"]), "local" if client["local"] else "remote",
            str(client["num_open_plans"]), str(client["num_sessions"]), str(client["num_segments"]),
        )  # fmt: skip
    console.print(clients)
    top = report["top_chunks"]
    if top:
        hits = Table(title="most planned chunks")
        hits.add_column("key")
        hits.add_column("hits")
        for chunk in top:  # type: ignore[attr-defined]
            hits.add_row(chunk["key"], f"{chunk['hits']:,}")
        console.print(hits)


def _render_misses(console: Console, lookups: dict[str, Any]) -> None:
    """Why looked-up tokens were not served, most tokens first, each as a share of all tokens looked up."""
    looked_up = int(lookups["looked_up_tokens"])
    missed: dict[str, int] = lookups["missed_tokens"]
    table = Table(title=f"missed tokens by reason ({looked_up:,} tokens looked up)")
    for column in ("reason", "tokens", "of looked up"):
        table.add_column(column)
    for reason, count in sorted(missed.items(), key=lambda item: -item[1]):
        table.add_row(reason, f"{count:,}", f"{count / looked_up:.1%}" if looked_up else "-")
    if not missed:
        table.add_row("-", "0", "-")
    console.print(table)


def evict_on_server(
    url: str, keys: list[PrefixKey], num_bytes: int | None, tier: TierName | None, as_json: bool
) -> None:
    """Evict through a running server: by key, by bytes of one tier (or each), or everything unpinned (``num_bytes``
    ``None`` without keys). ``kvstore evict`` has asked first where it should."""
    with _connect(url) as client:
        before = client.stats().tiers
        missing: list[str] = []
        still_cached: list[str] = []
        if keys:
            missing = [key.hex() for key in keys if not client.chunk(key).tiers]
            client.evict(keys)
            still_cached = [key.hex() for key in keys if client.chunk(key).tiers]
        else:
            server_tiers = [t.tier for t in client.server.tiers]
            chosen = [tier] if tier is not None else server_tiers
            if tier is not None and tier not in server_tiers:
                names = ",".join(t.value for t in server_tiers)
                raise ConfigError(f"--tier {tier.value}: the server's tiers are {names}")
            to_free = num_bytes if num_bytes is not None else _EVERYTHING_BYTES
            for chosen_tier in chosen:
                client.evict_bytes(to_free, chosen_tier)
        after = client.stats().tiers
    report = eviction_report(
        data_dir=None, url=url, before=before, after=after, not_found=missing, still_cached=still_cached
    )
    echo_eviction(report, as_json)
    if missing:
        raise typer.Exit(1)
