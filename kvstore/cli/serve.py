"""``kvstore serve``: run a store server in the foreground until SIGINT (Ctrl-C) or SIGTERM.

The server, its settings and the store (torch, LMDB, ZeroMQ) are imported inside the functions that run it, not
here: ``kvstore serve --help`` reads only this module's signature, and must not take seconds (issue 27); and a bad
flag is refused by ``check_flags`` (``kvstore.server.serve_flags``, which imports none of them) before they are
imported.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import typer

from kvstore.cli.quantities import count_text, size_text
from kvstore.errors import ConfigError
from kvstore.pids import pid_alive
from kvstore.server.host_facts import available_memory_bytes
from kvstore.server.serve_flags import check_flags, check_given_sizes_fit
from kvstore.server.serve_sources import ServeFlags, flag_name
from kvstore.version import __version__

if TYPE_CHECKING:
    from kvstore.server.app import ServerAddress
    from kvstore.server.settings import ServerSettings

__all__ = ["serve_command"]

logger = logging.getLogger(__name__)

_OWNER_POLL_S = 0.5


def serve_command(
    tiers: str | None = typer.Option(
        None,
        "--tiers",
        help="Tiers, fastest first, of gpu,cpu,disk,remote (default: gpu,cpu,disk with CUDA, else cpu,disk).",
    ),
    chunk_size: int | None = typer.Option(
        None, "--chunk-size", help="Tokens per chunk (default: the data dir's, else 256)."
    ),
    chunk_separator: str | None = typer.Option(
        None,
        "--chunk-separator",
        help="Token ids after which a chunk restarts, e.g. 198,198: a RAG template's document delimiter, so a "
        "document is found wherever a prompt puts it (default: none).",
    ),
    gpu_size: str | None = typer.Option(
        None, "--gpu-size", help="gpu tier size, e.g. 16GiB (default: 4GiB, <= 1/4 free)."
    ),
    cpu_size: str | None = typer.Option(
        None, "--cpu-size", help="cpu tier size, e.g. 64GiB (default: 4GiB, <= 1/4 RAM)."
    ),
    data_dir: Path | None = typer.Option(None, "--data-dir", help="The data dir (default: ./kvstore-data)."),
    disk_size: str | None = typer.Option(
        None, "--disk-size", help="disk tier cap in stored bytes, e.g. 500GiB (default: 64GiB, <= 1/2 free disk)."
    ),
    enable_blend: bool | None = typer.Option(
        None, "--enable-blend/--disable-blend", help="Find cached chunks anywhere in a prompt (content index)."
    ),
    enable_segmented_prefix: bool | None = typer.Option(
        None, "--enable-segmented-prefix/--disable-segmented-prefix", help="A missing chunk mid-prefix is a gap."
    ),
    enable_dedup_content: bool | None = typer.Option(
        None, "--enable-dedup-content/--disable-dedup-content", help="Store equal content once (needs blend)."
    ),
    host: str | None = typer.Option(None, "--host", help="Interface to listen on (default: 127.0.0.1)."),
    port: int | None = typer.Option(None, "--port", help="ZeroMQ port (default: 5555; 0: any free port)."),
    metrics_port: int | None = typer.Option(
        None, "--metrics-port", help="HTTP port of /metrics and /healthz (default: 5556; 0: any free port)."
    ),
    layout: str | None = typer.Option(
        None,
        "--layout",
        help="Model layout: a preset (llama3.1-8b, smollm2-135m) or a JSON file (default: the data dir's, else the "
        "first client's).",
    ),
    workers: int | None = typer.Option(None, "--workers", help="Threads per pool (lookups; bulk) (default: 4)."),
    plan_ttl_s: float | None = typer.Option(
        None, "--plan-ttl-s", help="Release plans not retrieved within this many seconds (default: 600)."
    ),
    remote_url: str | None = typer.Option(
        None,
        "--remote-url",
        help="The remote tier's Valkey/Redis, one node or a cluster: valkey://HOST:PORT, valkeys:// for TLS "
        "(password: KVSTORE_REMOTE_PASSWORD).",
    ),
    remote_namespace: str | None = typer.Option(
        None, "--remote-namespace", help="Prefix of this deployment's keys in the remote (default: kvstore)."
    ),
    remote_timeout_ms: int | None = typer.Option(
        None, "--remote-timeout-ms", help="Longest a request waits on the remote per round trip (default: 250)."
    ),
    remote_write: str | None = typer.Option(
        None,
        "--remote-write",
        help="through: new chunks go to the remote at once; evict: only when they leave the disk (default: through).",
    ),
    kv_events: str | None = typer.Option(
        None,
        "--kv-events",
        help="Publish the store's residency as vLLM KV events for routers: tcp://*:5557 binds, tcp://HOST:PORT "
        "connects (default: off).",
    ),
    kv_events_replay: str | None = typer.Option(
        None, "--kv-events-replay", help="Bind a replay and snapshot socket for KV events, e.g. tcp://*:5558."
    ),
    kv_events_topic: str | None = typer.Option(
        None, "--kv-events-topic", help="The topic frame of every KV event message (default: empty)."
    ),
    kv_events_interval_ms: float | None = typer.Option(
        None,
        "--kv-events-interval-ms",
        help="How long residency changes wait to join a KV event batch: a router sees them that much later; shorter "
        "costs the server more CPU (default: 50).",
    ),
    kv_events_replay_mib: int | None = typer.Option(
        None,
        "--kv-events-replay-mib",
        help="How many MiB of published KV event batches the server keeps for replay requests, the oldest dropped "
        "first (default: 256).",
    ),
    config: Path | None = typer.Option(
        None, "--config", help='TOML file; keys are the flags\' names (cpu_size = "8GiB"). Flags > KVSTORE_* > file.'
    ),
    exit_with_pid: int | None = typer.Option(
        None,
        "--exit-with-pid",
        help="Stop (flushing, as on SIGTERM) once process PID is gone: how an engine's embedded server ends with it.",
    ),
) -> None:
    """Serve a tiered KV store to engines on this host (shared memory) or the network (inline bytes).

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
    flags = ServeFlags(
        tiers=tiers,
        chunk_size=chunk_size,
        chunk_separator=chunk_separator,
        gpu_size=gpu_size,
        cpu_size=cpu_size,
        data_dir=data_dir,
        disk_size=disk_size,
        enable_blend=enable_blend,
        enable_segmented_prefix=enable_segmented_prefix,
        enable_dedup_content=enable_dedup_content,
        host=host,
        port=port,
        metrics_port=metrics_port,
        layout=layout,
        workers=workers,
        plan_ttl_s=plan_ttl_s,
        remote_url=remote_url,
        remote_namespace=remote_namespace,
        remote_timeout_ms=remote_timeout_ms,
        remote_write=remote_write,
        kv_events=kv_events,
        kv_events_replay=kv_events_replay,
        kv_events_topic=kv_events_topic,
        kv_events_interval_ms=kv_events_interval_ms,
        kv_events_replay_mib=kv_events_replay_mib,
    )
    checked = check_flags(flags, config)  # before the server's imports: a bad flag is refused at once
    check_given_sizes_fit(checked, available_memory_bytes())
    stop = threading.Event()
    if exit_with_pid is not None:
        _stop_when_gone(exit_with_pid, stop)
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
