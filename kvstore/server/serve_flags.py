"""``kvstore serve``'s settings as given, merged (flag > ``KVSTORE_*`` environment > TOML config file > default) and
checked as far as they can be without this machine's facts, the data dir's LMDB or a ``KVLayout``.

Why a module of its own: ``kvstore serve --port 99999`` must be refused in a fraction of a second, before torch,
numba, LMDB and the store are imported. This module imports none of them; ``kvstore.cli.serve``
runs ``check_flags`` and ``check_given_sizes_fit`` (the given cpu and disk sizes against ``MemAvailable`` and the
free disk, which need no torch) first and only then imports ``kvstore.server.settings``, whose ``complete_settings``
takes the ``CheckedFlags`` on (default tiers and sizes, every size against RAM, device memory and disk with the same
``check_fits``, the data dir's recorded layout and chunk size, a chunk of the layout in every tier). Every check is
written once, in one of the two modules.

The settings' names and sources (``ServeFlags``, the config file, the environment) are ``kvstore.server.serve_sources``.

Checked here, each failure one line (``ConfigError``, or ``StorageError`` for a data dir another server holds):
tiers (names, order, a local tier above remote), sizes (parsed; a tier too small for a chunk of any plausible model
when no layout is known), ``--layout`` (a preset name or a file), the data dir (a directory or creatable, not held
by a live server), every ``StoreConfig`` rule (chunk size, separator, blend and dedup, the remote's URL, namespace,
timeout and write policy), host, ports, workers, plan TTL and the KV event options.

Pure functions over an environment mapping (tests pass their own).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvstore.chunking import Chunking, parse_chunking
from kvstore.config import DEFAULT_DATA_DIR, GIB, StoreConfig, parse_chunk_separator, parse_size, parse_tiers
from kvstore.data_dir.server_record import live_server_record
from kvstore.errors import ConfigError, StorageError
from kvstore.preset_names import PRESET_NAMES, SMALLEST_PRESET, SMALLEST_PRESET_ELEMENTS_PER_TOKEN
from kvstore.server.host_facts import free_disk_bytes
from kvstore.server.kv_events.options import KVEventOptions
from kvstore.server.serve_sources import (
    REMOTE_PASSWORD_ENV,
    ServeFlags,
    env_name,
    flag_name,
    load_config_file,
    merge_sources,
    read_environment,
)
from kvstore.tiers.names import TierName
from kvstore.wire.address import check_server_url

__all__ = [
    "CheckedFlags",
    "GivenSizes",
    "check_data_dir_path",
    "check_fits",
    "check_flags",
    "check_given_sizes_fit",
    "check_room_for_a_chunk",
    "size_text",
]

_MIB = 1024 * 1024
_PROVISIONAL_TIERS = (TierName.CPU, TierName.DISK)
"""The default tiers as far as this module can tell (``gpu`` joins them with CUDA, which only torch can see); the
rules checked here do not depend on whether ``gpu`` is among them."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GivenSizes:
    """The tier sizes that were given (bytes; ``None``: the host decides the default)."""

    gpu_bytes: int | None
    cpu_bytes: int | None
    disk_bytes: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckedFlags:
    """``kvstore serve``'s settings after every check that needs no host facts, LMDB or ``KVLayout``.

    Args:
        store: the store's settings, every ``StoreConfig`` rule checked; provisional in what the host or the data
            dir decide (``resolve_settings`` replaces the tiers when ``tiers`` is ``None``, the chunk size and the
            cut rule when the data dir recorded them, and the sizes).
        tiers: the tiers given; ``None``: the default (``gpu`` joins ``cpu,disk`` with CUDA).
        chunk_size: the chunk size given; ``None``: the data dir's, else the default.
        chunking: the cut rule given; ``None``: the data dir's, else ``fixed``.
        sizes: the sizes given.
        layout: ``--layout`` as given (a preset name or an existing file); ``None``: not given.
        host: the interface to listen on.
        port: the server's TCP port (0: any free one).
        metrics_port: the HTTP port of ``/metrics`` and ``/healthz`` (0: any free one).
        num_workers: threads per pool.
        plan_ttl_s: plans neither retrieved nor released are released after this.
        kv_events: where the residency is published as vLLM KV events; ``None``: nowhere.
        given_by: each setting that was given -> where: ``--cpu-size``, ``KVSTORE_CPU_SIZE`` or ``FILE cpu_size``.
    """

    store: StoreConfig
    tiers: tuple[TierName, ...] | None
    chunk_size: int | None
    sizes: GivenSizes
    layout: str | None
    host: str
    port: int
    metrics_port: int
    num_workers: int
    plan_ttl_s: float
    kv_events: KVEventOptions | None
    given_by: Mapping[str, str] = field(default_factory=dict)
    chunking: Chunking | None = None


def check_flags(
    flags: ServeFlags, config_file: Path | None = None, environ: Mapping[str, str] | None = None
) -> CheckedFlags:
    """Merge flags, environment (``os.environ`` when ``None``), config file and defaults, and check what needs
    neither this machine's facts nor the data dir's contents.

    Raises:
        ConfigError: an invalid setting (one line naming it and the fix).
        StorageError: a live server already holds the data dir.
    """
    from_file = load_config_file(config_file) if config_file is not None else ServeFlags()
    environ = os.environ if environ is None else environ
    merged, given_by = merge_sources(
        [
            (flags, flag_name),
            (read_environment(environ), env_name),
            (from_file, lambda setting: f"{config_file} {setting}"),
        ]
    )
    tiers = parse_tiers(merged.tiers) if merged.tiers is not None else None
    if merged.layout is not None:
        _check_layout_option(merged.layout)
    data_dir = merged.data_dir or DEFAULT_DATA_DIR
    if TierName.DISK in (tiers or _PROVISIONAL_TIERS):
        check_data_dir_path(data_dir)
        holder = live_server_record(data_dir)
        if holder is not None:
            raise StorageError(
                f"data dir {data_dir} is held by kvstore serve (pid {holder.pid}) at {holder.url}; stop it, or "
                "use another --data-dir"
            )
    sizes = GivenSizes(
        gpu_bytes=_size("gpu_size", merged.gpu_size),
        cpu_bytes=_size("cpu_size", merged.cpu_size),
        disk_bytes=_size("disk_size", merged.disk_size),
    )
    defaults = StoreConfig()
    store = StoreConfig(
        tiers=tiers or _PROVISIONAL_TIERS,
        chunk_size=merged.chunk_size if merged.chunk_size is not None else defaults.chunk_size,
        chunk_separator=parse_chunk_separator(merged.chunk_separator or ""),
        chunking=parse_chunking(merged.chunking) if merged.chunking is not None else defaults.chunking,
        gpu_capacity_bytes=_or(sizes.gpu_bytes, defaults.gpu_capacity_bytes),
        cpu_capacity_bytes=_or(sizes.cpu_bytes, defaults.cpu_capacity_bytes),
        disk_capacity_bytes=_or(sizes.disk_bytes, defaults.disk_capacity_bytes),
        data_dir=data_dir,
        enable_blend=bool(merged.enable_blend),
        enable_segmented_prefix=bool(merged.enable_segmented_prefix),
        enable_dedup_content=bool(merged.enable_dedup_content),
        remote_url=merged.remote_url,
        remote_password=environ.get(REMOTE_PASSWORD_ENV),
        remote_namespace=merged.remote_namespace or defaults.remote_namespace,
        remote_timeout_ms=_or(merged.remote_timeout_ms, defaults.remote_timeout_ms),
        remote_write=merged.remote_write or defaults.remote_write,
    )
    if merged.layout is None and not _records_a_layout(store):
        check_room_for_a_chunk(store, None)  # the floor now; resolve_settings checks a given layout's chunk
    host = merged.host if merged.host is not None else "127.0.0.1"
    if not host or any(c.isspace() for c in host):
        raise ConfigError(f"--host {host!r} is not an interface address (e.g. 127.0.0.1 or 0.0.0.0)")
    workers = merged.workers if merged.workers is not None else 4
    if not 1 <= workers <= 64:
        raise ConfigError(f"--workers {workers} must be between 1 and 64")
    plan_ttl_s = float(merged.plan_ttl_s) if merged.plan_ttl_s is not None else 600.0
    if not (math.isfinite(plan_ttl_s) and plan_ttl_s > 0):
        raise ConfigError(f"--plan-ttl-s {plan_ttl_s} must be a positive number of seconds")
    return CheckedFlags(
        store=store,
        tiers=tiers,
        chunk_size=merged.chunk_size,
        sizes=sizes,
        layout=merged.layout,
        host=host,
        port=_port("port", _or(merged.port, 5555)),
        metrics_port=_port("metrics-port", _or(merged.metrics_port, 5556)),
        num_workers=workers,
        plan_ttl_s=plan_ttl_s,
        kv_events=_kv_events(merged),
        given_by=given_by,
        chunking=parse_chunking(merged.chunking) if merged.chunking is not None else None,
    )


def _or(value: int | None, default: int) -> int:
    return value if value is not None else default


def _check_layout_option(text: str) -> None:
    """``--layout``: a preset name, or a file (``resolve_settings`` reads it as ``KVLayout.to_json()``)."""
    if text not in PRESET_NAMES and not Path(text).is_file():
        raise ConfigError(f"--layout {text!r} is neither a preset ({', '.join(PRESET_NAMES)}) nor a JSON file")


def _records_a_layout(store: StoreConfig) -> bool:
    """Whether the data dir may have recorded a layout (it then decides the chunk that must fit, not the floor)."""
    return TierName.DISK in store.tiers and (store.data_dir / "data.mdb").exists()


def _size(setting: str, text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return parse_size(text)
    except ConfigError as exc:  # parse_size says why (not a size, or not whole bytes); name the flag
        raise ConfigError(f"{flag_name(setting)}: {exc}") from None


def check_data_dir_path(data_dir: Path) -> None:
    """Refuse a ``--data-dir`` that can never be a data dir, before anything is created or sized from it.

    Raises:
        ConfigError: a file, or a path that cannot be created (no writable parent, a virtual filesystem).
    """
    if data_dir.exists():
        if not data_dir.is_dir():
            raise ConfigError(f"--data-dir {data_dir} is not a directory; choose a directory for the data dir")
        return
    parent = data_dir.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot create data dir {data_dir}: {parent} is not a writable directory")
    if os.statvfs(parent).f_blocks == 0:
        raise ConfigError(
            f"cannot create data dir {data_dir}: {parent} is a virtual filesystem with no storage; choose a "
            "--data-dir on a disk"
        )


def check_room_for_a_chunk(store: StoreConfig, chunk_bytes: int | None, layout_name: str | None = None) -> None:
    """Refuse a tier too small for one chunk before start-up: it would refuse every client later.

    Without a layout yet (none given, none recorded: the first client's will decide) the floor is a chunk of the
    smallest plausible model: the smallest preset (SmolLM2-135M) with one-byte (fp8) KV elements, 11,520 bytes a
    token, 2.81 MiB a 256-token chunk. A smaller test model names its layout with ``--layout``.

    Args:
        store: the tiers and their sizes.
        chunk_bytes: a chunk of the known layout; ``None``: no layout is known yet (the floor applies).
        layout_name: the known layout, as its message names it.

    Raises:
        ConfigError: a gpu, cpu or disk tier smaller than that chunk.
    """
    floor = chunk_bytes is None
    needed = SMALLEST_PRESET_ELEMENTS_PER_TOKEN * store.chunk_size if chunk_bytes is None else chunk_bytes
    sizes = {
        TierName.GPU: ("--gpu-size", store.gpu_capacity_bytes),
        TierName.CPU: ("--cpu-size", store.cpu_capacity_bytes),
        TierName.DISK: ("--disk-size", store.disk_capacity_bytes),
    }
    for tier in store.tiers:
        if tier not in sizes:
            continue  # the remote's room is Valkey's maxmemory
        flag, size = sizes[tier]
        if size >= needed:
            continue
        if floor:
            raise ConfigError(
                f"{flag} {size_text(size)} leaves the {tier.value} tier no room for a chunk of any model: without "
                f"--layout the floor is one chunk of the smallest preset ({SMALLEST_PRESET} with fp8 KV: "
                f"{store.chunk_size} tokens take {needed / _MIB:.2f} MiB); raise {flag}, or name a smaller test "
                "model with --layout FILE.json"
            )
        raise ConfigError(
            f"{flag} {size_text(size)} leaves the {tier.value} tier no room for one chunk ({needed / _MIB:.2f} MiB "
            f"of {layout_name}); raise it or drop {tier.value} from --tiers"
        )


def check_fits(setting: str, wanted_bytes: int, available_bytes: int, where: str) -> None:
    """Refuse a size larger than what this machine has (one line naming the flag and what is available).

    Raises:
        ConfigError: ``wanted_bytes`` is more than ``available_bytes``.
    """
    if wanted_bytes > available_bytes:
        flag = flag_name(setting)
        raise ConfigError(
            f"{flag} {wanted_bytes / GIB:.2f}GiB does not fit: {available_bytes / GIB:.2f} GiB of {where} is "
            f"available; lower {flag}"
        )


def check_given_sizes_fit(checked: CheckedFlags, available_memory_bytes: int) -> None:
    """The given cpu and disk sizes against this machine's RAM and free disk, before torch is imported (``kvstore
    serve`` calls it with ``MemAvailable``; ``resolve_settings`` checks every size, the gpu's included, with the same
    ``check_fits``: the device's free memory needs torch).

    Raises:
        ConfigError: a given size does not fit.
    """
    tiers = checked.tiers or _PROVISIONAL_TIERS
    if checked.sizes.cpu_bytes is not None and TierName.CPU in tiers:
        check_fits("cpu_size", checked.sizes.cpu_bytes, available_memory_bytes, "RAM")
    if checked.sizes.disk_bytes is not None and TierName.DISK in tiers:
        data_dir = checked.store.data_dir
        check_fits("disk_size", checked.sizes.disk_bytes, free_disk_bytes(data_dir), f"disk under {data_dir}")


def size_text(num_bytes: int) -> str:
    """A size as a flag takes it, in the largest binary unit that keeps it whole (``512MiB``, not ``0.5GiB``)."""
    for unit, scale in (("GiB", GIB), ("MiB", _MIB), ("KiB", 1024)):
        if num_bytes and num_bytes % scale == 0:
            return f"{num_bytes // scale}{unit}"
    return f"{num_bytes}B"


def _port(name: str, value: int) -> int:
    if not 0 <= value <= 65535:
        raise ConfigError(f"--{name} {value} is not a TCP port (0-65535; 0 picks a free one)")
    return value


def _kv_events(flags: ServeFlags) -> KVEventOptions | None:
    if flags.kv_events is None:
        if any(value is not None for value in (flags.kv_events_replay, flags.kv_events_topic,
                                                flags.kv_events_interval_ms, flags.kv_events_replay_mib)):  # fmt: skip
            raise ConfigError(
                "--kv-events-replay, --kv-events-topic, --kv-events-interval-ms and --kv-events-replay-mib need "
                "--kv-events (where events are published)"
            )
        return None
    options = KVEventOptions(
        endpoint=flags.kv_events, replay_endpoint=flags.kv_events_replay, topic=flags.kv_events_topic or ""
    )
    if flags.kv_events_interval_ms is not None:
        interval_ms = float(flags.kv_events_interval_ms)
        if not (math.isfinite(interval_ms) and 1 <= interval_ms <= 10_000):
            raise ConfigError(f"--kv-events-interval-ms {interval_ms:g} must be between 1 and 10000 milliseconds")
        options = replace(options, interval_s=interval_ms / 1000)
    if flags.kv_events_replay_mib is not None:
        if not 1 <= flags.kv_events_replay_mib <= 65_536:
            raise ConfigError(f"--kv-events-replay-mib {flags.kv_events_replay_mib} must be between 1 and 65536")
        options = replace(options, buffer_bytes=flags.kv_events_replay_mib << 20)
    endpoints = [("--kv-events", flags.kv_events)]
    if flags.kv_events_replay is not None:
        endpoints.append(("--kv-events-replay", flags.kv_events_replay))
    for flag, endpoint in endpoints:
        try:
            check_server_url(endpoint)  # a tcp:// host and port or an ipc:// path, as a server's address is
        except ConfigError as exc:
            raise ConfigError(f"{flag}: {exc} (events: tcp://*:5557 binds, tcp://router:5557 connects)") from None
    return options
