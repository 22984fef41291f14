"""``kvstore serve``: run a store server in the foreground until SIGINT (Ctrl-C) or SIGTERM.

Its options are ``ServeFlags``' settings, each declared once in ``kvstore.server.serve_sources`` with its help text,
plus ``--config`` and ``--exit-with-pid`` (``serve_options``); ``declared_command`` builds the typer command from them.

The server, its settings and the store (torch, LMDB, ZeroMQ) are imported inside the functions that run it, not
here: ``kvstore serve --help`` reads only the options, and must not take seconds; and a bad flag is refused by
``check_flags`` (``kvstore.server.serve_flags``, which imports none of them) before they are imported.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import typer

from kvstore.cli.declared_options import CliOption, GivenValues, OptionTarget, declared_command
from kvstore.cli.quantities import count_text, size_text
from kvstore.errors import ConfigError
from kvstore.pids import pid_alive
from kvstore.server.host_facts import available_memory_bytes
from kvstore.server.serve_flags import check_flags, check_given_sizes_fit
from kvstore.server.serve_sources import ServeFlags, flag_name, serve_settings
from kvstore.version import __version__

if TYPE_CHECKING:
    from kvstore.server.app import ServerAddress
    from kvstore.server.settings import ServerSettings

__all__ = ["serve_command", "serve_options"]

logger = logging.getLogger(__name__)

_OWNER_POLL_S = 0.5


_SERVE_HELP = """Serve a tiered KV store to engines on this host (shared memory) or the network (inline bytes).

    Runs in the foreground; Ctrl-C or SIGTERM finishes requests in flight, flushes pending disk writes and exits 0.
    One server serves one model layout; its data dir keeps the cache across restarts. Every flag is also a config
    file key (--cpu-size: cpu_size) and an environment variable (KVSTORE_CPU_SIZE); a flag wins over the
    environment, which wins over the file.

    Examples:

        kvstore serve

        kvstore serve --tiers gpu,cpu,disk --gpu-size 16GiB --cpu-size 64GiB

        kvstore serve --data-dir /nvme/kvstore --disk-size 500GiB --enable-blend

        kvstore serve --layout llama3.1-8b --port 5555 --metrics-port 5556

        kvstore serve --config kvstore.toml --port 6000

        kvstore serve --tiers cpu,disk,remote --remote-url valkey://cache:6379

        kvstore serve --kv-events tcp://*:5557 --kv-events-replay tcp://*:5558
    """

_COMMAND_OPTIONS = (
    CliOption(
        name="config",
        declaration="--config",
        annotation=Path | None,
        help_text='TOML file; keys are the flags\' names (cpu_size = "8GiB"). Flags > KVSTORE_* > file.',
    ),
    CliOption(
        name="exit_with_pid",
        declaration="--exit-with-pid",
        annotation=int | None,
        help_text="Stop (flushing, as on SIGTERM) once process PID is gone: how an engine's embedded server ends with "
        "it.",
    ),
)
"""The options of the command that are not settings of the server (those are ``ServeFlags``' fields)."""


def serve_options() -> tuple[CliOption, ...]:
    """``kvstore serve``'s options: one per ``ServeFlags`` setting, in its order, then ``--config`` and
    ``--exit-with-pid``."""
    settings = tuple(
        CliOption(
            name=setting.name,
            declaration=setting.declaration,
            annotation=setting.kind | None,
            help_text=setting.help_text,
            targets=(OptionTarget(options_class=ServeFlags, field_name=setting.name),),
        )
        for setting in serve_settings()
    )
    return settings + _COMMAND_OPTIONS


def _run(given: GivenValues) -> None:
    """Check the settings before the server's imports (a bad flag is refused at once), then serve until stopped."""
    checked = check_flags(given.build(ServeFlags), given.path("config"))
    check_given_sizes_fit(checked, available_memory_bytes())
    stop = threading.Event()
    if given["exit_with_pid"] is not None:
        _stop_when_gone(given["exit_with_pid"], stop)
    from kvstore.server.app import run_server
    from kvstore.server.host_facts import probe_host
    from kvstore.server.settings import complete_settings

    settings = complete_settings(checked, probe_host())

    def request_stop(signum: int, frame: FrameType | None) -> None:
        if stop.is_set():
            typer.echo("kvstore serve: already stopping (finishing requests, flushing the disk tier)", err=True)
        stop.set()

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}

    def announce(address: ServerAddress) -> None:
        for line in startup_lines(settings, address):
            typer.echo(f"kvstore serve: {line}")
        typer.echo("kvstore serve: Ctrl-C to stop", err=True)

    try:
        run_server(settings, stop, announce)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    typer.echo("kvstore serve: stopped (pending disk writes flushed)")


serve_command = declared_command(serve_options(), _run, _SERVE_HELP)


def startup_lines(settings: ServerSettings, address: ServerAddress) -> list[str]:
    """What an operator needs to see at start: the version, where it listens, the layout, what each tier takes --
    the defaults included, since they silently claim RAM and disk -- and how to connect to it."""
    from kvstore.remote_address import parse_remote_url
    from kvstore.tiers.names import TierName

    store = settings.store
    layout_text = settings.layout.describe() if settings.layout is not None else "set by the first client"
    lines = [
        f"kvstore {__version__} listening on {address.url} (metrics {address.metrics_url})",
        f"layout {layout_text}; chunks of {store.chunk_size} tokens"
        + (", at most, cut by content" if store.chunking.value == "content" else "")
        + (f", restarting after {','.join(map(str, store.chunk_separator))}" if store.chunk_separator else ""),
    ]
    defaults = {
        TierName.GPU: ("of GPU memory", "gpu_size", "4GiB, at most 1/4 of free GPU memory"),
        TierName.CPU: ("of RAM", "cpu_size", "4GiB, at most a quarter of available RAM"),
        TierName.DISK: ("of stored bytes", "disk_size", "64GiB, at most half the free disk"),
    }
    capacities = {
        TierName.GPU: store.gpu_capacity_bytes,
        TierName.CPU: store.cpu_capacity_bytes,
        TierName.DISK: store.disk_capacity_bytes,
    }
    for tier in store.tiers:
        if tier is TierName.REMOTE:
            assert store.remote_url is not None, "StoreConfig checks that the remote tier has a URL"
            lines.append(
                f"remote tier: {parse_remote_url(store.remote_url).describe()}, namespace {store.remote_namespace}, "
                f"{store.remote_timeout_ms} ms per round trip at most, chunks written {store.remote_write}"
            )
            continue
        where, setting, default = defaults[tier]
        given_by = settings.given_by.get(setting)
        origin = f"set by {given_by}" if given_by else f"the default: {default}; {flag_name(setting)} to change"
        lines.append(f"{tier.value} tier: {size_text(capacities[tier])} {where} ({origin})")
    if TierName.DISK in store.tiers:
        data_dir = store.data_dir.absolute()
        recovered = (
            f"{count_text(address.disk_chunks, 'chunk')} recovered from disk"
            if address.disk_chunks is not None
            else "opened when the first client names the layout"
        )
        lines.append(f"data dir {data_dir}: {recovered}")
    events = settings.kv_events
    if events is not None:
        replay = f", replay and snapshots on {events.replay_endpoint}" if events.replay_endpoint else ", no replay"
        lines.append(
            f"kv events: published on {events.endpoint} every {1000 * events.interval_s:g} ms{replay} (docs/routing.md)"
        )
        if not events.binds:  # a PUB socket that connects drops what it sends until the other end is there
            lines.append(
                f"kv events: connecting to {events.endpoint}: events go nowhere until a subscriber (a router that "
                "binds) is listening there; tcp://*:PORT binds instead"
            )
    lines.append(f'connect: kvstore.Client("{address.url}"); look: kvstore inspect --url {address.url}')
    return lines


def _stop_when_gone(pid: int, stop: threading.Event) -> None:
    """Set ``stop`` once process ``pid`` no longer exists (checked every half second on a daemon thread)."""
    if not pid_alive(pid):
        raise ConfigError(f"--exit-with-pid {pid}: no such process")

    def watch() -> None:
        while not stop.wait(_OWNER_POLL_S):
            if not pid_alive(pid):
                logger.info("process %d is gone: stopping", pid)
                stop.set()

    threading.Thread(target=watch, name="kvstore-owner-watch", daemon=True).start()
