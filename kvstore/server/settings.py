"""``kvstore serve``'s settings: flags over a TOML config file over defaults, checked before anything starts.

Precedence: a flag given on the command line, else the key of the same name in ``--config FILE`` (keys mirror the
flags with ``_`` for ``-``: ``cpu_size_gb = 8``), else the default. Sizes are GiB (2^30 bytes; fractions allowed).

Checked before start-up, each failure one line (``ConfigError`` / ``LayoutMismatchError``):
- tiers: a non-empty, fastest-first subset of gpu, cpu, disk; gpu only with CUDA;
- the data dir: a ``--chunk-size`` or ``--layout`` that disagrees with what it recorded; held by another server;
- sizes: a cpu tier larger than the available RAM, a gpu tier larger than the free device memory, a disk tier
  larger than the free disk (plus what the data dir already holds);
- ports, workers, TTL in range; an unknown config key or a key of the wrong type.

Defaults serve out of the box: tiers gpu,cpu,disk with CUDA else cpu,disk; chunk size = the data dir's, else 256;
cpu 4 GiB (at most a quarter of the available RAM), gpu 4 GiB (at most a quarter of the free device memory), disk
64 GiB (at most half the free disk); ``./kvstore-data``; 127.0.0.1:5555, metrics on 5556.

Pure functions over a ``HostFacts`` value (tests pass their own machine).
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from kvstore.config import DEFAULT_DATA_DIR, GIB, StoreConfig, parse_tiers
from kvstore.data_dir.server_record import live_server_record
from kvstore.errors import ConfigError, LayoutMismatchError, StorageError
from kvstore.layout import KVLayout
from kvstore.presets import PRESET_NAMES, preset_layout
from kvstore.server.host_facts import HostFacts, free_disk_bytes
from kvstore.server.loop import LoopOptions
from kvstore.tiers.base import TierName
from kvstore.tiers.disk.environment import DiskEnvironment

__all__ = ["ServeFlags", "ServerSettings", "load_config_file", "resolve_settings"]

_DEFAULT_CHUNK_SIZE = 256
_DEFAULT_MEMORY_TIER_BYTES = 4 * GIB
_DEFAULT_DISK_BYTES = 64 * GIB
_MIB = 1024 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeFlags:
    """``kvstore serve``'s options as given; ``None`` means "not given" (the config file or default decides)."""

    tiers: str | None = None
    chunk_size: int | None = None
    gpu_size_gb: float | None = None
    cpu_size_gb: float | None = None
    disk_path: Path | None = None
    disk_size_gb: float | None = None
    enable_blend: bool | None = None
    enable_segmented_prefix: bool | None = None
    enable_dedup_content: bool | None = None
    host: str | None = None
    port: int | None = None
    metrics_port: int | None = None
    layout: str | None = None
    workers: int | None = None
    plan_ttl_s: float | None = None


_KEY_TYPES: dict[str, tuple[type, ...]] = {
    "tiers": (str, list),
    "chunk_size": (int,),
    "gpu_size_gb": (int, float),
    "cpu_size_gb": (int, float),
    "disk_path": (str,),
    "disk_size_gb": (int, float),
    "enable_blend": (bool,),
    "enable_segmented_prefix": (bool,),
    "enable_dedup_content": (bool,),
    "host": (str,),
    "port": (int,),
    "metrics_port": (int,),
    "layout": (str,),
    "workers": (int,),
    "plan_ttl_s": (int, float),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerSettings:
    """Everything a server starts with, checked.

    Args:
        store: the store's settings (bytes).
        layout: the layout to open with at start-up; ``None``: the first client's.
        loop: address, workers, plan TTL.
        metrics_port: HTTP port of ``/metrics`` and ``/healthz`` (0: any free port).
    """

    store: StoreConfig
    layout: KVLayout | None
    loop: LoopOptions
    metrics_port: int


def load_config_file(path: Path) -> ServeFlags:
    """Read a TOML config file whose keys mirror the flags.

    Raises:
        ConfigError: unreadable, not TOML, an unknown key, or a value of the wrong type.
    """
    try:
        with open(path, "rb") as file:
            raw = tomllib.load(file)
    except OSError as exc:
        raise ConfigError(f"cannot read --config {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path} is not TOML: {exc}") from exc
    values: dict[str, object] = {}
    for key, value in raw.items():
        if key not in _KEY_TYPES:
            raise ConfigError(f"unknown key {key!r} in {path}; keys mirror the flags: {', '.join(sorted(_KEY_TYPES))}")
        if type(value) not in _KEY_TYPES[key]:
            expected = " or ".join(t.__name__ for t in _KEY_TYPES[key])
            raise ConfigError(f"{path}: {key} = {value!r} must be a {expected}")
        if key == "tiers" and isinstance(value, list):
            if not all(isinstance(item, str) for item in value):
                raise ConfigError(f'{path}: tiers must be a string or a list of strings, e.g. ["cpu", "disk"]')
            value = ",".join(value)
        values[key] = Path(value) if key == "disk_path" and isinstance(value, str) else value
    return ServeFlags(**values)  # type: ignore[arg-type]


def _merge(flags: ServeFlags, file: ServeFlags) -> ServeFlags:
    values = {name: getattr(flags, name) for name in ServeFlags.__slots__}
    for name, value in values.items():
        if value is None:
            values[name] = getattr(file, name)
    return ServeFlags(**values)


def read_layout_option(text: str) -> KVLayout:
    """``--layout``: a preset name (``llama3.1-8b``) or a JSON file holding ``KVLayout.to_json()``."""
    if text in PRESET_NAMES:
        return preset_layout(text)
    path = Path(text)
    if not path.is_file():
        raise ConfigError(f"--layout {text!r} is neither a preset ({', '.join(PRESET_NAMES)}) nor a JSON file")
    try:
        return KVLayout.from_json(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read --layout {path}: {exc.strerror}") from exc


def _gib(name: str, value: float | None, default_bytes: int) -> int:
    if value is None:
        return default_bytes
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"--{name.replace('_', '-')} {value} must be a non-negative number of GiB")
    return int(value * GIB)


def _check_fits(name: str, wanted_bytes: int, available_bytes: int, where: str) -> None:
    if wanted_bytes > available_bytes:
        raise ConfigError(
            f"--{name} {wanted_bytes / GIB:.2f} GiB does not fit: {available_bytes / GIB:.2f} GiB of {where} is "
            f"available; lower --{name}"
        )


def _recorded(disk_path: Path) -> tuple[KVLayout, int] | None:
    """The layout and chunk size a data dir recorded, or ``None`` for a fresh dir."""
    if not (disk_path / "data.mdb").is_file():
        return None
    try:
        env = DiskEnvironment(disk_path, read_only=True, map_size_bytes=64 * _MIB)
    except StorageError:
        return None
    try:
        info = env.read_info()
    finally:
        env.close()
    return (info.layout, info.chunk_size) if info is not None else None


def resolve_settings(flags: ServeFlags, host: HostFacts, config_file: Path | None = None) -> ServerSettings:
    """Merge flags, config file and defaults, and check them against this machine and the data dir.

    Raises:
        ConfigError: an invalid or impossible setting (one line naming it and the fix).
        LayoutMismatchError: ``--layout`` or ``--chunk-size`` disagrees with the data dir.
        StorageError: a live server already holds the data dir.
    """
    merged = _merge(flags, load_config_file(config_file)) if config_file is not None else flags
    tiers = parse_tiers(merged.tiers) if merged.tiers is not None else _default_tiers(host)
    if TierName.GPU in tiers and not host.cuda_available:
        raise ConfigError("--tiers includes gpu, but torch sees no CUDA device; use --tiers cpu,disk")
    layout = read_layout_option(merged.layout) if merged.layout is not None else None
    disk_path = merged.disk_path or DEFAULT_DATA_DIR
    chunk_size = merged.chunk_size
    if TierName.DISK in tiers:
        _check_data_dir_path(disk_path)
        holder = live_server_record(disk_path)
        if holder is not None:
            raise StorageError(
                f"data dir {disk_path} is held by kvstore serve (pid {holder.pid}) at {holder.url}; stop it, or "
                "use another --disk-path"
            )
        recorded = _recorded(disk_path)
        if recorded is not None:
            recorded_layout, recorded_chunk_size = recorded
            if chunk_size is not None and chunk_size != recorded_chunk_size:
                raise LayoutMismatchError(
                    f"--chunk-size {chunk_size} disagrees with data dir {disk_path} (created with "
                    f"{recorded_chunk_size}); pass --chunk-size {recorded_chunk_size} or use another --disk-path"
                )
            if layout is not None and layout.namespace != recorded_layout.namespace:
                raise LayoutMismatchError(
                    f"--layout {layout.describe()} disagrees with data dir {disk_path}, which holds "
                    f"{recorded_layout.describe()}; use another --disk-path for this model"
                )
            chunk_size, layout = recorded_chunk_size, recorded_layout
    sizes = _sizes(merged, tiers, host, disk_path)
    store = StoreConfig(
        tiers=tiers,
        chunk_size=chunk_size if chunk_size is not None else _DEFAULT_CHUNK_SIZE,
        gpu_capacity_bytes=sizes.gpu_bytes,
        cpu_capacity_bytes=sizes.cpu_bytes,
        disk_capacity_bytes=sizes.disk_bytes,
        disk_path=disk_path,
        enable_blend=bool(merged.enable_blend),
        enable_segmented_prefix=bool(merged.enable_segmented_prefix),
        enable_dedup_content=bool(merged.enable_dedup_content),
    )
    _check_room_for_a_chunk(store, layout)
    return ServerSettings(store=store, layout=layout, loop=_loop_options(merged), metrics_port=_metrics_port(merged))


def _check_data_dir_path(disk_path: Path) -> None:
    """Refuse a ``--disk-path`` that can never be a data dir, before anything is created or sized from it."""
    if disk_path.exists():
        if not disk_path.is_dir():
            raise ConfigError(f"--disk-path {disk_path} is not a directory; choose a directory for the data dir")
        return
    parent = disk_path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot create data dir {disk_path}: {parent} is not a writable directory")
    if os.statvfs(parent).f_blocks == 0:
        raise ConfigError(
            f"cannot create data dir {disk_path}: {parent} is a virtual filesystem with no storage; choose a "
            "--disk-path on a disk"
        )


def _check_room_for_a_chunk(store: StoreConfig, layout: KVLayout | None) -> None:
    """Refuse a tier too small for one chunk before start-up (it would refuse every client later). Without a
    layout yet (none given, none recorded) only an empty tier can be refused."""
    chunk_bytes = layout.chunk_bytes(store.chunk_size) if layout is not None else 1
    sizes = {
        TierName.GPU: ("gpu-size-gb", store.gpu_capacity_bytes),
        TierName.CPU: ("cpu-size-gb", store.cpu_capacity_bytes),
        TierName.DISK: ("disk-size-gb", store.disk_capacity_bytes),
    }
    for tier in store.tiers:
        flag, size = sizes[tier]
        if size < chunk_bytes:
            one_chunk = f"one chunk ({chunk_bytes / _MIB:.2f} MiB of {layout.describe()})" if layout else "any chunk"
            raise ConfigError(
                f"--{flag} {size / GIB:g} leaves the {tier.value} tier no room for {one_chunk}; raise it or drop "
                f"{tier.value} from --tiers"
            )


def _default_tiers(host: HostFacts) -> tuple[TierName, ...]:
    if host.cuda_available:
        return (TierName.GPU, TierName.CPU, TierName.DISK)
    return (TierName.CPU, TierName.DISK)


@dataclass(frozen=True, slots=True, kw_only=True)
class _TierSizes:
    gpu_bytes: int
    cpu_bytes: int
    disk_bytes: int


def _sizes(flags: ServeFlags, tiers: tuple[TierName, ...], host: HostFacts, disk_path: Path) -> _TierSizes:
    memory_default = min(_DEFAULT_MEMORY_TIER_BYTES, host.available_memory_bytes // 4)
    cpu_bytes = _gib("cpu_size_gb", flags.cpu_size_gb, memory_default)
    gpu_bytes = _gib("gpu_size_gb", flags.gpu_size_gb, min(_DEFAULT_MEMORY_TIER_BYTES, host.gpu_free_bytes // 4))
    if TierName.CPU in tiers:
        _check_fits("cpu-size-gb", cpu_bytes, host.available_memory_bytes, "RAM")
    if TierName.GPU in tiers:
        _check_fits("gpu-size-gb", gpu_bytes, host.gpu_free_bytes, "free GPU memory")
    disk_bytes = _DEFAULT_DISK_BYTES
    if TierName.DISK in tiers:
        free = free_disk_bytes(disk_path)
        disk_bytes = _gib("disk_size_gb", flags.disk_size_gb, min(_DEFAULT_DISK_BYTES, free // 2))
        _check_fits("disk-size-gb", disk_bytes, free, f"disk under {disk_path}")
    return _TierSizes(gpu_bytes=gpu_bytes, cpu_bytes=cpu_bytes, disk_bytes=disk_bytes)


def _port(name: str, value: int, allow_zero: bool = True) -> int:
    if not (0 if allow_zero else 1) <= value <= 65535:
        raise ConfigError(f"--{name} {value} is not a TCP port (0-65535; 0 picks a free one)")
    return value


def _loop_options(flags: ServeFlags) -> LoopOptions:
    host = flags.host if flags.host is not None else "127.0.0.1"
    if not host or any(c.isspace() for c in host):
        raise ConfigError(f"--host {host!r} is not an interface address (e.g. 127.0.0.1 or 0.0.0.0)")
    workers = flags.workers if flags.workers is not None else 4
    if not 1 <= workers <= 64:
        raise ConfigError(f"--workers {workers} must be between 1 and 64")
    plan_ttl_s = float(flags.plan_ttl_s) if flags.plan_ttl_s is not None else 600.0
    if not (math.isfinite(plan_ttl_s) and plan_ttl_s > 0):
        raise ConfigError(f"--plan-ttl-s {plan_ttl_s} must be a positive number of seconds")
    return LoopOptions(
        host=host,
        port=_port("port", flags.port if flags.port is not None else 5555),
        num_control_workers=workers,
        num_bulk_workers=workers,
        plan_ttl_s=plan_ttl_s,
    )


def _metrics_port(flags: ServeFlags) -> int:
    return _port("metrics-port", flags.metrics_port if flags.metrics_port is not None else 5556)
