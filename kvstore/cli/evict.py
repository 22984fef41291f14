"""``kvstore evict``: drop chunks from a data dir that no running process holds, or through a running server
(``--url``, ``kvstore.cli.online``).

LMDB, the disk tier and the client are imported only after the arguments are checked: a mistake is refused at once.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from kvstore.cli.quantities import size_text
from kvstore.cli.server_probe import check_listening
from kvstore.config import DEFAULT_DATA_DIR, parse_size
from kvstore.data_dir.server_record import live_server_record
from kvstore.errors import ConfigError, StorageError
from kvstore.tiers.names import TierName

__all__ = ["evict_command"]

_EVERYTHING_BYTES = 2**62


def evict_command(
    data_dir: Path | None = typer.Option(
        None, "--data-dir", help="The data dir (holds data.mdb; default: ./kvstore-data)."
    ),
    keys: list[str] = typer.Option([], "--key", help="A chunk key to drop (32 hex digits); repeat for more."),
    num_bytes: str | None = typer.Option(None, "--bytes", help="Free this much, least recently used first (2GiB)."),
    everything: bool = typer.Option(False, "--all", help="Drop every chunk (asks first unless --yes)."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask before --bytes or --all."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object with what was dropped."),
    url: str | None = typer.Option(None, "--url", help="Evict through a running server (tcp://host:port)."),
    tier_option: str | None = typer.Option(
        None, "--tier", help="With --url: the tier --bytes/--all frees (default: each)."
    ),
) -> None:
    """Drop chunks by key, by bytes to free, or all of them.

    --bytes and --all ask first (--yes does not): --bytes 10G empties most data dirs.

    Offline (--data-dir), the data dir must not be held by a running store or server (it is refused with the holder's
    pid; a server's data dir is refused with its --url). With --url the server evicts (pinned chunks stay).

    Examples:

        kvstore evict --key 288dbd46d2eda1e6f6a95d9411f8f6cc

        kvstore evict --data-dir ./kvstore-data --bytes 2GiB --yes

        kvstore evict --data-dir ./kvstore-data --all --yes

        kvstore evict --url tcp://127.0.0.1:5555 --bytes 2GiB --tier cpu --yes
    """
    chosen = sum([bool(keys), num_bytes is not None, everything])
    if chosen != 1:
        raise ConfigError("say what to evict: exactly one of --key (repeatable), --bytes SIZE or --all")
    bytes_to_free = parse_size(num_bytes) if num_bytes is not None else _EVERYTHING_BYTES
    if url is not None:
        if data_dir is not None:
            raise ConfigError("--url evicts through a running server, --data-dir offline: give one of them")
        tier_name = _tier(tier_option) if tier_option is not None else None
        check_listening(url)
        from kvstore.cli.online import evict_on_server
        from kvstore.keys import key_from_hex

        parsed_keys = [key_from_hex(text) for text in keys]
        if not yes and not parsed_keys:
            _confirm(_what_is_dropped(num_bytes, tier_name, f"the server at {url}"))
        evict_on_server(url, parsed_keys, bytes_to_free if num_bytes is not None else None, tier_name, as_json)
        return
    path = data_dir if data_dir is not None else DEFAULT_DATA_DIR
    if tier_option is not None:
        raise ConfigError("--tier picks a tier of a running server; add --url (offline eviction is disk only)")
    _check_offline(path)
    if not yes and not keys:
        _confirm(_what_is_dropped(num_bytes, None, str(path)))
    if not _evict_offline(path, keys, bytes_to_free, as_json):
        raise typer.Exit(1)


def _check_offline(path: Path) -> None:
    """Refuse a data dir a server holds (naming its ``--url``) or one no store used, before LMDB is imported."""
    holder = live_server_record(path)
    if holder is not None:
        raise StorageError(
            f"data dir {path} is held by kvstore serve (pid {holder.pid}); evict through it: "
            f"kvstore evict --url {holder.url} ..."
        )
    if not (path / "data.mdb").is_file():
        raise StorageError(f"{path} is not a kvstore data dir (no data.mdb); pass the --data-dir a store used")


def _evict_offline(path: Path, keys: list[str], bytes_to_free: int, as_json: bool) -> bool:
    """Drop ``keys`` (hex) from the data dir's disk tier, or else ``bytes_to_free``, and print what was dropped;
    whether every key was found."""
    from rich.console import Console
    from rich.progress import Progress

    from kvstore.cli.eviction_report import echo_eviction, eviction_report
    from kvstore.keys import key_from_hex
    from kvstore.tiers.disk.tier import DiskTier

    parsed_keys = [key_from_hex(text) for text in keys]
    tier = DiskTier.open_existing(path, read_only=False, num_codec_threads=1)
    try:
        before = tier.stats()
        missing: list[str] = []
        if parsed_keys:
            with Progress(console=Console(stderr=True), transient=True, disable=as_json) as progress:
                for key in progress.track(parsed_keys, description="evicting"):
                    if not tier.evict(key):
                        missing.append(key.hex())
        else:
            tier.evict_bytes(bytes_to_free)
        tier.flush()
        after = tier.stats()
    finally:
        tier.close()
    report = eviction_report(data_dir=path, url=None, before=[before], after=[after], not_found=missing)
    echo_eviction(report, as_json)
    return not missing


def _what_is_dropped(num_bytes: str | None, tier: TierName | None, where: str) -> str:
    """The question --bytes and --all ask, naming how much and where."""
    of_tier = f" of the {tier.value} tier" if tier is not None else ""
    if num_bytes is None:
        return f"drop every {'unpinned ' if where.startswith('the server') else ''}chunk{of_tier} in {where}?"
    return f"drop chunks{of_tier} in {where} until {size_text(parse_size(num_bytes))} are freed, least recent first?"


def _confirm(question: str) -> None:
    """Ask ``question`` on the terminal (no answer: abort); without a terminal, refuse: a script must say --yes."""
    if not sys.stdin.isatty():
        raise ConfigError(f"--bytes and --all ask first and there is no terminal to ask on; add --yes ({question})")
    typer.confirm(question, abort=True)


def _tier(text: str) -> TierName:
    try:
        return TierName(text.strip().lower())
    except ValueError:
        raise ConfigError(f"--tier {text!r} must be one of gpu, cpu, disk") from None
