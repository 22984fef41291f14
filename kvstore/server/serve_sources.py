"""``kvstore serve``'s settings as given, and where they come from: flags, ``KVSTORE_*`` environment variables and a
TOML config file, merged in that precedence (flag > environment > config file > default).

One vocabulary: each field of ``ServeFlags`` is one setting, spelled ``--cpu-size`` as a flag, ``cpu_size`` in the
config file and ``KVSTORE_CPU_SIZE`` in the environment (all three derived from the field, never kept by hand).
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
from dataclasses import dataclass, fields, replace
from pathlib import Path

from kvstore.errors import ConfigError

__all__ = [
    "ENV_PREFIX",
    "NON_SETTING_VARIABLES",
    "REMOTE_PASSWORD_ENV",
    "ServeFlags",
    "env_name",
    "flag_name",
    "load_config_file",
    "merge_sources",
    "read_environment",
]

ENV_PREFIX = "KVSTORE_"
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
