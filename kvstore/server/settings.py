"""``kvstore serve``'s settings: flags over ``KVSTORE_*`` environment variables over a TOML config file over
defaults, checked before anything starts.

One vocabulary: each field of ``ServeFlags`` is one setting, spelled ``--cpu-size`` as a flag, ``cpu_size`` in the
config file and ``KVSTORE_CPU_SIZE`` in the environment (all three derived from the field, never kept by hand).
Sizes are strings everywhere (``4GiB``, ``512MiB``, ``2GB``; a config file may also give a byte count); booleans in
the environment are ``1/true/yes/on`` or ``0/false/no/off``. Precedence: flag > environment > config file > default.

Checked before start-up, each failure one line (``ConfigError`` / ``LayoutMismatchError``):
- tiers: a non-empty, fastest-first subset of gpu, cpu, disk, remote; gpu only with CUDA; remote with
  ``--remote-url`` (its password from ``KVSTORE_REMOTE_PASSWORD`` or the URL);
- the data dir: a ``--chunk-size`` or ``--layout`` that disagrees with what it recorded; held by another server;
- sizes: a cpu tier larger than the available RAM, a gpu tier larger than the free device memory, a disk tier
  larger than the free disk (plus what the data dir already holds);
- ports, workers, TTL in range; an unknown config key, or a value of the wrong type in the file or environment.

Defaults serve out of the box: tiers gpu,cpu,disk with CUDA else cpu,disk; chunk size = the data dir's, else 256;
cpu 4 GiB (at most a quarter of the available RAM), gpu 4 GiB (at most a quarter of the free device memory), disk
64 GiB (at most half the free disk); ``./kvstore-data``; 127.0.0.1:5555, metrics on 5556.

Pure functions over a ``HostFacts`` value and an environment mapping (tests pass their own).
"""

from __future__ import annotations

import math
import os
import tomllib
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from kvstore.config import DEFAULT_DATA_DIR, GIB, StoreConfig, parse_chunk_separator, parse_size, parse_tiers
from kvstore.data_dir.server_record import live_server_record
from kvstore.errors import ConfigError, LayoutMismatchError, StorageError
from kvstore.layout import KVDtype, KVLayout
from kvstore.presets import PRESET_NAMES, preset_layout
from kvstore.server.host_facts import HostFacts, free_disk_bytes
from kvstore.server.kv_events.options import KVEventOptions
from kvstore.server.loop import LoopOptions
from kvstore.tiers.base import TierName
from kvstore.tiers.disk.layout_copy import recorded_layout
from kvstore.wire.address import check_server_url

__all__ = [
    "ENV_PREFIX",
    "NON_SETTING_VARIABLES",
    "ServeFlags",
    "ServerSettings",
    "env_name",
    "flag_name",
    "load_config_file",
    "read_environment",
    "resolve_settings",
]

ENV_PREFIX = "KVSTORE_"
_STORE_DEFAULTS = StoreConfig()  # the one source of the store's defaults; the host may lower the sizes
_DEFAULT_CHUNK_SIZE = _STORE_DEFAULTS.chunk_size
_DEFAULT_MEMORY_TIER_BYTES = _STORE_DEFAULTS.cpu_capacity_bytes
_DEFAULT_DISK_BYTES = _STORE_DEFAULTS.disk_capacity_bytes
_MIB = 1024 * 1024
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeFlags:
    """``kvstore serve``'s settings as given; ``None`` means "not given" (the next source or the default decides).

    Each field is one setting under three spellings: ``flag_name``, the config-file key (the field's name) and
    ``env_name``.
    """

    tiers: str | None = None
    chunk_size: int | None = None
    chunk_separator: str | None = None
    gpu_size: str | None = None
    cpu_size: str | None = None
    data_dir: Path | None = None
    disk_size: str | None = None
    enable_blend: bool | None = None
    enable_segmented_prefix: bool | None = None
    enable_dedup_content: bool | None = None
    host: str | None = None
    port: int | None = None
    metrics_port: int | None = None
    layout: str | None = None
    workers: int | None = None
    plan_ttl_s: float | None = None
    remote_url: str | None = None
    remote_namespace: str | None = None
    remote_timeout_ms: int | None = None
    remote_write: str | None = None
    kv_events: str | None = None
    kv_events_replay: str | None = None
    kv_events_topic: str | None = None
    kv_events_interval_ms: float | None = None
    kv_events_replay_mib: int | None = None


def flag_name(setting: str) -> str:
    """``cpu_size`` -> ``--cpu-size``."""
    return "--" + setting.replace("_", "-")


def env_name(setting: str) -> str:
    """``cpu_size`` -> ``KVSTORE_CPU_SIZE``."""
    return ENV_PREFIX + setting.upper()


def _setting_types() -> dict[str, type]:
    """Each setting's type without ``None`` (``str``, ``int``, ``float``, ``bool`` or ``Path``), from the fields."""
    hints = typing.get_type_hints(ServeFlags)
    types = {}
    for setting in fields(ServeFlags):
        (kind,) = (arg for arg in typing.get_args(hints[setting.name]) if arg is not type(None))
        types[setting.name] = kind
    return types


_SETTING_TYPES = _setting_types()
_SIZES = ("gpu_size", "cpu_size", "disk_size")


def load_config_file(path: Path) -> ServeFlags:
    """Read a TOML config file whose keys are the settings' names (``cpu_size = "8GiB"``).

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
        if key not in _SETTING_TYPES:
            raise ConfigError(f"unknown key {key!r} in {path}; the keys are: {', '.join(sorted(_SETTING_TYPES))}")
        values[key] = _from_toml(f"{path}: {key}", key, value)
    return ServeFlags(**values)  # type: ignore[arg-type]


def _from_toml(where: str, setting: str, value: object) -> object:
    kind = _SETTING_TYPES[setting]
    if setting == "tiers" and isinstance(value, list):
        if not all(isinstance(item, str) for item in value):
            raise ConfigError(f'{where} must be a string or a list of strings, e.g. ["cpu", "disk"]')
        return ",".join(value)
    if setting in _SIZES and type(value) is int:
        return str(value)  # a byte count
    accepted: tuple[type, ...] = {float: (int, float), Path: (str,)}.get(kind, (kind,))
    if type(value) not in accepted:
        expected = 'a size string such as "8GiB"' if setting in _SIZES else " or ".join(t.__name__ for t in accepted)
        raise ConfigError(f"{where} = {value!r} must be {expected}")
    return Path(value) if kind is Path else value  # type: ignore[arg-type]


def read_environment(environ: Mapping[str, str]) -> ServeFlags:
    """The settings given as ``KVSTORE_*`` variables (other variables are ignored).

    Raises:
        ConfigError: a variable whose value is not of its setting's type, or a ``KVSTORE_`` name that is no setting.
    """
    values: dict[str, object] = {}
    settings = {env_name(setting): setting for setting in _SETTING_TYPES}
    for name, text in environ.items():
        if not name.startswith(ENV_PREFIX) or name in NON_SETTING_VARIABLES:
            continue
        setting = settings.get(name)
        if setting is None:
            raise ConfigError(f"unknown variable {name}; kvstore serve reads {', '.join(sorted(settings))}")
        values[setting] = _from_text(f"{name}={text}", _SETTING_TYPES[setting], text)
    return ServeFlags(**values)  # type: ignore[arg-type]


REMOTE_PASSWORD_ENV = "KVSTORE_REMOTE_PASSWORD"
"""The remote tier's password, read only from the environment: a flag would show it in ``ps``."""

NON_SETTING_VARIABLES = frozenset(
    {"KVSTORE_CACHE_DIR", "KVSTORE_CONNECTOR_TRACE", "KVSTORE_VALKEY_SERVER", REMOTE_PASSWORD_ENV}
)
"""``KVSTORE_*`` variables that are not server settings (the model cache, the connector's trace, the benchmarks'
and tests' valkey-server, a secret)."""


def _from_text(where: str, kind: type, text: str) -> object:
    if kind is bool:
        if text.strip().lower() not in (*_TRUE, *_FALSE):
            raise ConfigError(f"{where} must be one of {'/'.join(_TRUE)} or {'/'.join(_FALSE)}")
        return text.strip().lower() in _TRUE
    if kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            raise ConfigError(f"{where} must be {'an integer' if kind is int else 'a number'}") from None
    return Path(text) if kind is Path else text


def _merge(sources: Sequence[tuple[ServeFlags, Callable[[str], str]]]) -> tuple[ServeFlags, dict[str, str]]:
    """Each setting from the first source (in precedence order) that gives it, and where it came from (each source's
    callable names a setting as that source spells it)."""
    merged = ServeFlags()
    given_by: dict[str, str] = {}
    for setting in _SETTING_TYPES:
        for source, spelling in sources:
            value = getattr(source, setting)
            if value is not None:
                merged = replace(merged, **{setting: value})
                given_by[setting] = spelling(setting)
                break
    return merged, given_by


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerSettings:
    """Everything a server starts with, checked.

    Args:
        store: the store's settings (bytes).
        layout: the layout to open with at start-up; ``None``: the first client's.
        loop: address, workers, plan TTL.
        metrics_port: HTTP port of ``/metrics`` and ``/healthz`` (0: any free port).
        kv_events: where the store's residency is published as vLLM KV events; ``None``: nowhere.
        given_by: each setting that was given (not defaulted) -> where: ``--cpu-size``, ``KVSTORE_CPU_SIZE`` or
            ``FILE cpu_size``.
    """

    store: StoreConfig
    layout: KVLayout | None
    loop: LoopOptions
    metrics_port: int
    kv_events: KVEventOptions | None = None
    given_by: Mapping[str, str] = field(default_factory=dict)


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


def _size(setting: str, text: str | None, default_bytes: int) -> int:
    if text is None:
        return default_bytes
    try:
        return parse_size(text)
    except ConfigError as exc:  # parse_size says why (not a size, or not whole bytes); name the flag
        raise ConfigError(f"{flag_name(setting)}: {exc}") from None


def _check_fits(setting: str, wanted_bytes: int, available_bytes: int, where: str) -> None:
    if wanted_bytes > available_bytes:
        flag = flag_name(setting)
        raise ConfigError(
            f"{flag} {wanted_bytes / GIB:.2f}GiB does not fit: {available_bytes / GIB:.2f} GiB of {where} is "
            f"available; lower {flag}"
        )


def resolve_settings(
    flags: ServeFlags, host: HostFacts, config_file: Path | None = None, environ: Mapping[str, str] | None = None
) -> ServerSettings:
    """Merge flags, environment (``os.environ`` when ``None``), config file and defaults, and check them against this
    machine and the data dir.

    Raises:
        ConfigError: an invalid or impossible setting (one line naming it and the fix).
        LayoutMismatchError: ``--layout`` or ``--chunk-size`` disagrees with the data dir.
        StorageError: a live server already holds the data dir.
    """
    from_file = load_config_file(config_file) if config_file is not None else ServeFlags()
    environ = os.environ if environ is None else environ
    merged, given_by = _merge(
        [
            (flags, flag_name),
            (read_environment(environ), env_name),
            (from_file, lambda setting: f"{config_file} {setting}"),
        ]
    )
    tiers = parse_tiers(merged.tiers) if merged.tiers is not None else _default_tiers(host)
    if TierName.GPU in tiers and not host.cuda_available:
        raise ConfigError("--tiers includes gpu, but torch sees no CUDA device; use --tiers cpu,disk")
    layout = read_layout_option(merged.layout) if merged.layout is not None else None
    data_dir = merged.data_dir or DEFAULT_DATA_DIR
    chunk_size = merged.chunk_size
    if TierName.DISK in tiers:
        _check_data_dir_path(data_dir)
        holder = live_server_record(data_dir)
        if holder is not None:
            raise StorageError(
                f"data dir {data_dir} is held by kvstore serve (pid {holder.pid}) at {holder.url}; stop it, or "
                "use another --data-dir"
            )
        recorded = recorded_layout(data_dir)
        if recorded is not None:
            held_layout, recorded_chunk_size = recorded
            if chunk_size is not None and chunk_size != recorded_chunk_size:
                raise LayoutMismatchError(
                    f"--chunk-size {chunk_size} disagrees with data dir {data_dir} (created with "
                    f"{recorded_chunk_size}); pass --chunk-size {recorded_chunk_size} or use another --data-dir"
                )
            if layout is not None and layout.namespace != held_layout.namespace:
                raise LayoutMismatchError(
                    f"--layout {layout.describe()} disagrees with data dir {data_dir}, which holds "
                    f"{held_layout.describe()}; use another --data-dir for this model"
                )
            chunk_size, layout = recorded_chunk_size, held_layout
    sizes = _sizes(merged, tiers, host, data_dir)
    store = StoreConfig(
        tiers=tiers,
        chunk_size=chunk_size if chunk_size is not None else _DEFAULT_CHUNK_SIZE,
        chunk_separator=parse_chunk_separator(merged.chunk_separator or ""),
        gpu_capacity_bytes=sizes.gpu_bytes,
        cpu_capacity_bytes=sizes.cpu_bytes,
        disk_capacity_bytes=sizes.disk_bytes,
        data_dir=data_dir,
        enable_blend=bool(merged.enable_blend),
        enable_segmented_prefix=bool(merged.enable_segmented_prefix),
        enable_dedup_content=bool(merged.enable_dedup_content),
        remote_url=merged.remote_url,
        remote_password=environ.get(REMOTE_PASSWORD_ENV),
        remote_namespace=merged.remote_namespace or _STORE_DEFAULTS.remote_namespace,
        remote_timeout_ms=(
            merged.remote_timeout_ms if merged.remote_timeout_ms is not None else _STORE_DEFAULTS.remote_timeout_ms
        ),
        remote_write=merged.remote_write or _STORE_DEFAULTS.remote_write,
    )
    _check_room_for_a_chunk(store, layout)
    return ServerSettings(
        store=store,
        layout=layout,
        loop=_loop_options(merged),
        metrics_port=_metrics_port(merged),
        kv_events=_kv_events(merged),
        given_by=given_by,
    )


def _check_data_dir_path(data_dir: Path) -> None:
    """Refuse a ``--data-dir`` that can never be a data dir, before anything is created or sized from it."""
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


def _check_room_for_a_chunk(store: StoreConfig, layout: KVLayout | None) -> None:
    """Refuse a tier too small for one chunk before start-up (it would refuse every client later). Without a
    layout yet (none given, none recorded) a tier smaller than the smallest chunk of any layout is refused (one
    layer, one KV head of one dimension, 16-bit: 4 bytes a token); the first client's layout is checked when it
    registers."""
    smallest_chunk_bytes = 2 * min(dtype.element_size_bytes for dtype in KVDtype) * store.chunk_size
    chunk_bytes = layout.chunk_bytes(store.chunk_size) if layout is not None else smallest_chunk_bytes
    sizes = {
        TierName.GPU: ("--gpu-size", store.gpu_capacity_bytes),
        TierName.CPU: ("--cpu-size", store.cpu_capacity_bytes),
        TierName.DISK: ("--disk-size", store.disk_capacity_bytes),
    }
    for tier in store.tiers:
        if tier not in sizes:
            continue  # the remote's room is Valkey's maxmemory
        flag, size = sizes[tier]
        if size < chunk_bytes:
            one_chunk = (
                f"one chunk ({chunk_bytes / _MIB:.2f} MiB of {layout.describe()})"
                if layout
                else f"a chunk of any model ({store.chunk_size} tokens take at least {chunk_bytes} bytes)"
            )
            raise ConfigError(
                f"{flag} {_size_text(size)} leaves the {tier.value} tier no room for {one_chunk}; raise it or drop "
                f"{tier.value} from --tiers"
            )


def _size_text(num_bytes: int) -> str:
    """A size as a flag takes it, in the largest binary unit that keeps it whole (``512MiB``, not ``0.5GiB``)."""
    for unit, scale in (("GiB", GIB), ("MiB", _MIB), ("KiB", 1024)):
        if num_bytes and num_bytes % scale == 0:
            return f"{num_bytes // scale}{unit}"
    return f"{num_bytes}B"


def _default_tiers(host: HostFacts) -> tuple[TierName, ...]:
    if host.cuda_available:
        return (TierName.GPU, TierName.CPU, TierName.DISK)
    return (TierName.CPU, TierName.DISK)


@dataclass(frozen=True, slots=True, kw_only=True)
class _TierSizes:
    gpu_bytes: int
    cpu_bytes: int
    disk_bytes: int


def _sizes(flags: ServeFlags, tiers: tuple[TierName, ...], host: HostFacts, data_dir: Path) -> _TierSizes:
    memory_default = min(_DEFAULT_MEMORY_TIER_BYTES, host.available_memory_bytes // 4)
    cpu_bytes = _size("cpu_size", flags.cpu_size, memory_default)
    gpu_bytes = _size("gpu_size", flags.gpu_size, min(_DEFAULT_MEMORY_TIER_BYTES, host.gpu_free_bytes // 4))
    if TierName.CPU in tiers:
        _check_fits("cpu_size", cpu_bytes, host.available_memory_bytes, "RAM")
    if TierName.GPU in tiers:
        _check_fits("gpu_size", gpu_bytes, host.gpu_free_bytes, "free GPU memory")
    disk_bytes = _DEFAULT_DISK_BYTES
    if TierName.DISK in tiers:
        free = free_disk_bytes(data_dir)
        disk_bytes = _size("disk_size", flags.disk_size, min(_DEFAULT_DISK_BYTES, free // 2))
        _check_fits("disk_size", disk_bytes, free, f"disk under {data_dir}")
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


def _metrics_port(flags: ServeFlags) -> int:
    return _port("metrics-port", flags.metrics_port if flags.metrics_port is not None else 5556)
