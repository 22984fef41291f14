"""``kvstore serve``'s settings as given, and where they come from: flags, ``KVSTORE_*`` environment variables and a
TOML config file, merged in that precedence (flag > environment > config file > default).

One vocabulary: each field of ``ServeFlags`` is one setting, declared there once with its help text and spelled
``--cpu-size`` as a flag, ``cpu_size`` in the config file, ``KVSTORE_CPU_SIZE`` in the environment and
``kvstore.cpu_size`` in a connector's config (all derived from the field, never kept by hand; ``kvstore.cli.serve``
builds its options from ``serve_settings``).
Sizes are strings everywhere (``4GiB``, ``512MiB``, ``2GB``; a config file may also give a byte count); booleans in
the environment are ``1/true/yes/on`` or ``0/false/no/off``. A value of the wrong type, an unknown key or an
unknown ``KVSTORE_`` variable is a one-line ``ConfigError``; what the values mean is checked by
``kvstore.server.serve_flags`` and ``kvstore.server.settings``.

Imports nothing heavy (``kvstore serve`` reads it before torch is imported). Pure functions.
"""

from __future__ import annotations

import tomllib
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from kvstore.errors import ConfigError

__all__ = [
    "ENV_PREFIX",
    "NON_SETTING_VARIABLES",
    "REMOTE_PASSWORD_ENV",
    "ServeFlags",
    "ServeSetting",
    "env_name",
    "flag_name",
    "load_config_file",
    "merge_sources",
    "read_environment",
    "serve_settings",
]

ENV_PREFIX = "KVSTORE_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


_HELP_KEY = "help"


def _declared(help_text: str) -> Any:
    """A ``ServeFlags`` field, ``None`` (not given) by default; ``help_text`` is its ``kvstore serve --help`` line."""
    return field(default=None, metadata={_HELP_KEY: help_text})


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeFlags:
    """``kvstore serve``'s settings as given; ``None`` means "not given" (the next source or the default decides).

    The one declaration of every setting: each field is one setting under four spellings, all derived from it: the
    flag (``flag_name``; a ``bool`` is ``--enable-X/--disable-X``) with the field's help, the config-file key (the
    field's name), the ``KVSTORE_*`` variable (``env_name``) and the connector's ``kvstore.*`` key for the settings
    the embedded server takes. ``serve_settings`` lists them; tests check ``kvstore serve``'s options, the embedded
    server's settings and docs/settings.md's table against it.
    """

    tiers: str | None = _declared(
        "Tiers, fastest first, of gpu,cpu,disk,remote (default: gpu,cpu,disk with CUDA, else cpu,disk)."
    )
    chunk_size: int | None = _declared("Tokens per chunk (default: the data dir's, else 256).")
    chunk_separator: str | None = _declared(
        "Token ids after which a chunk restarts, e.g. 198,198: a RAG template's document delimiter, so a document is "
        "found wherever a prompt puts it (default: none)."
    )
    chunking: str | None = _declared(
        "How chunks are cut: fixed, every --chunk-size tokens; content, where a hash of the last 16 token ids says, so "
        "a document is cut alike wherever a prompt puts it (--chunk-size is then the longest chunk) (default: the data "
        "dir's, else fixed)."
    )
    gpu_size: str | None = _declared("gpu tier size, e.g. 16GiB (default: 4GiB, <= 1/4 free).")
    cpu_size: str | None = _declared("cpu tier size, e.g. 64GiB (default: 4GiB, <= 1/4 RAM).")
    data_dir: Path | None = _declared("The data dir (default: ./kvstore-data).")  # noqa: RUF009 (a field(), as above)
    disk_size: str | None = _declared("disk tier cap in stored bytes, e.g. 500GiB (default: 64GiB, <= 1/2 free disk).")
    enable_blend: bool | None = _declared("Find cached chunks anywhere in a prompt (content index).")
    enable_segmented_prefix: bool | None = _declared("A missing chunk mid-prefix is a gap.")
    enable_dedup_content: bool | None = _declared("Store equal content once (needs blend).")
    host: str | None = _declared("Interface to listen on (default: 127.0.0.1).")
    port: int | None = _declared("ZeroMQ port (default: 5555; 0: any free port).")
    metrics_port: int | None = _declared("HTTP port of /metrics and /healthz (default: 5556; 0: any free port).")
    layout: str | None = _declared(
        "Model layout: a preset (llama3.1-8b, smollm2-135m) or a JSON file (default: the data dir's, else the first "
        "client's)."
    )
    workers: int | None = _declared("Threads per pool (lookups; bulk) (default: 4).")
    plan_ttl_s: float | None = _declared("Release plans not retrieved within this many seconds (default: 600).")
    remote_url: str | None = _declared(
        "The remote tier's Valkey/Redis, one node or a cluster: valkey://HOST:PORT, valkeys:// for TLS (password: "
        "KVSTORE_REMOTE_PASSWORD)."
    )
    remote_namespace: str | None = _declared("Prefix of this deployment's keys in the remote (default: kvstore).")
    remote_timeout_ms: int | None = _declared("Longest a request waits on the remote per round trip (default: 250).")
    remote_write: str | None = _declared(
        "through: new chunks go to the remote at once; evict: only when they leave the disk (default: through)."
    )
    kv_events: str | None = _declared(
        "Publish the store's residency as vLLM KV events for routers: tcp://*:5557 binds, tcp://HOST:PORT connects "
        "(default: off)."
    )
    kv_events_replay: str | None = _declared("Bind a replay and snapshot socket for KV events, e.g. tcp://*:5558.")
    kv_events_topic: str | None = _declared("The topic frame of every KV event message (default: empty).")
    kv_events_interval_ms: float | None = _declared(
        "How long residency changes wait to join a KV event batch: a router sees them that much later; shorter costs "
        "the server more CPU (default: 50)."
    )
    kv_events_replay_mib: int | None = _declared(
        "How many MiB of published KV event batches the server keeps for replay requests, the oldest dropped first "
        "(default: 256)."
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeSetting:
    """One ``kvstore serve`` setting as ``ServeFlags`` declares it.

    Attributes:
        name: the field's name, also the config-file key (``cpu_size``).
        kind: its type without ``None``: ``str``, ``int``, ``float``, ``bool`` or ``Path``.
        help_text: its ``--help`` line.
    """

    name: str
    kind: type
    help_text: str

    @property
    def flag(self) -> str:
        """``--cpu-size``; a switch's first spelling (``--enable-blend``)."""
        return flag_name(self.name)

    @property
    def declaration(self) -> str:
        """The flag as the CLI declares it: ``--enable-blend/--disable-blend`` for a ``bool``."""
        if self.kind is bool:
            return f"{self.flag}/--disable-{self.name.removeprefix('enable_').replace('_', '-')}"
        return self.flag

    @property
    def env(self) -> str:
        """``KVSTORE_CPU_SIZE``."""
        return env_name(self.name)


def serve_settings() -> tuple[ServeSetting, ...]:
    """Every setting, in ``ServeFlags``' order (which is ``kvstore serve --help``'s)."""
    return tuple(
        ServeSetting(name=declared.name, kind=_SETTING_TYPES[declared.name], help_text=declared.metadata[_HELP_KEY])
        for declared in fields(ServeFlags)
    )


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


def merge_sources(sources: Sequence[tuple[ServeFlags, Callable[[str], str]]]) -> tuple[ServeFlags, dict[str, str]]:
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
