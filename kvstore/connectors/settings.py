"""A connector's settings: the ``kvstore.*`` keys of an engine's connector config, checked before anything starts.

vLLM users write them into ``kv_connector_extra_config``::

    {"kvstore.url": "tcp://127.0.0.1:5555"}                       # a running, shared ``kvstore serve``
    {"kvstore.data_dir": "/nvme/kv", "kvstore.cpu_size": "8GiB"}  # the embedded default: a private server
    {}                                                            # the same on ./kvstore-data/<model's dir name>

Every key starts with ``kvstore.``; an unknown key, a wrong type or a value out of range fails at start with one
line naming the key (a typo must not silently fall back to a default). Keys that configure the embedded server are
refused next to ``kvstore.url``: a shared server is configured where it runs. They are ``kvstore serve``'s settings
under the same names (``kvstore.cpu_size`` is ``--cpu-size``; ``ServeFlags`` in ``kvstore.server.serve_sources``
declares them, and a test holds ``EmbeddedServerSettings`` to it: this module may not import the server), sizes as
strings such as ``8GiB``.

Pure values; no engine imports.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from kvstore.chunking import parse_chunking
from kvstore.config import DEFAULT_DATA_DIR, check_chunk_separator, parse_size
from kvstore.errors import ConfigError
from kvstore.wire.address import check_server_url

if TYPE_CHECKING:
    from kvstore.layout import KVLayout

__all__ = [
    "BLEND_DISK_POLICIES",
    "BLEND_SELECTIONS",
    "ConnectorSettings",
    "EmbeddedServerSettings",
    "default_engine_data_dir",
    "parse_connector_settings",
    "settle_data_dir",
]

_PREFIX = "kvstore."

BLEND_DISK_POLICIES = ("auto", "wait", "recompute")
"""``kvstore.blend_disk_policy`` values: the layerwise blender's ``DiskPolicy`` (a test keeps them equal)."""
BLEND_SELECTIONS = (
    "kv_deviation",
    "query_attention",
    "chunk_start",
    "chunk_start+query_attention",
    "chunk_start+kv_deviation",
)
"""``kvstore.blend_selection`` values: the blender's ``SelectionPolicy`` (a test keeps them equal; the scheduler
side parses settings without importing torch)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EmbeddedServerSettings:
    """The private ``kvstore serve`` a connector starts when no ``kvstore.url`` is given.

    Args:
        data_dir: its data dir (the cache survives engine restarts there); ``None`` until the engine's layout is
            known, then ``default_engine_data_dir`` (``settle_data_dir``).
        tiers: ``kvstore serve --tiers`` (``None``: the server's default for the host).
        cpu_size: cpu tier size, e.g. ``8GiB`` (``None``: the server's default).
        gpu_size: gpu tier size (``None``: the server's default).
        disk_size: disk tier cap in stored bytes, e.g. ``500GiB`` (``None``: the server's default).
        chunk_size: tokens per chunk (``None``: the data dir's, else 256).
        chunking: ``kvstore serve --chunking``: ``content`` cuts where the tokens say, so a document is cut alike
            wherever it sits and whatever text precedes it (prompts as chat clients send them); ``fixed`` every
            ``chunk_size`` tokens (``None``: the data dir's, else ``fixed``).
        chunk_separator: ``kvstore serve --chunk-separator``: where chunks restart, so documents are found
            wherever a prompt puts them. Token ids, or a string the connector tokenizes with the engine's tokenizer
            (``resolve_chunk_separator``) before the server starts (``None``: fixed-size chunks).
        config: a ``kvstore serve --config`` TOML file for everything else.
        remote_url: ``kvstore serve --remote-url``: the fleet's Valkey (``tiers`` must end in ``remote``; the
            password comes from the engine's ``KVSTORE_REMOTE_PASSWORD``, which the server inherits).
        remote_namespace: ``kvstore serve --remote-namespace``.
        kv_events: ``kvstore serve --kv-events``: publish the store's residency as vLLM KV events for a router.
        kv_events_replay: ``kvstore serve --kv-events-replay``: their replay and snapshot socket.
        enable_blend: keep the content index (set from ``kvstore.blend``, not a key of its own).
    """

    data_dir: Path | None = None
    tiers: str | None = None
    cpu_size: str | None = None
    gpu_size: str | None = None
    disk_size: str | None = None
    chunk_size: int | None = None
    chunking: str | None = None
    chunk_separator: str | tuple[int, ...] | None = None
    config: Path | None = None
    remote_url: str | None = None
    remote_namespace: str | None = None
    kv_events: str | None = None
    kv_events_replay: str | None = None
    enable_blend: bool = False

    @property
    def settled_data_dir(self) -> Path:
        """The data dir, once ``settle_data_dir`` gave the default one."""
        assert self.data_dir is not None, "settle_data_dir gives the default data dir before a server is found"
        return self.data_dir

    def serve_flags(self) -> list[str]:
        """``kvstore serve`` flags for these settings (the data dir included)."""
        flags = ["--data-dir", str(self.settled_data_dir)] + (["--enable-blend"] if self.enable_blend else [])
        for name in _PASSED_AS_THEY_ARE:
            value = getattr(self, name)
            if value is not None:
                flags += ["--" + name.replace("_", "-"), str(value)]
        if self.chunk_separator:
            if isinstance(self.chunk_separator, str):
                raise ConfigError("kvstore.chunk_separator must be tokenized (resolve_chunk_separator) before start")
            flags += ["--chunk-separator", ",".join(map(str, self.chunk_separator))]
        return flags


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectorSettings:
    """Where the store is and how the connector talks to it.

    Args:
        url: a running ``kvstore serve`` (``None``: start a private one with ``embedded``).
        embedded: the private server's settings (unused with ``url``).
        model_id: the layout's model id (``None``: the engine's served model name); engines share cached KV only
            under the same id, so point two engines that load one model from different paths at one id.
        lookup_timeout_s: the longest a scheduler lookup may wait before the step goes on without the cache.
        transfer_timeout_s: the longest a load or a save may wait for the server.
        retry_s: after a failure, how long the connector serves without the store before trying again.
        async_disk_loads: load hits that must come from the disk tier off the engine's step (vLLM schedules the
            request once they land); ``False`` loads them inside the step.
        blend: CacheBlend inside the engine: cached chunks found anywhere in a prompt (by content) are re-rotated
            and blended by a layerwise pass on the engine's model, for every request that does not opt out
            (``kv_transfer_params``); needs kvstore's vLLM plugin and a server with ``--enable-blend`` (the
            embedded one gets it).
        blend_ratio: the share of blended tokens recomputed (CacheBlend's 0.15; 1.0 reproduces a full prefill).
        blend_check_layer: the layer at which the recomputed tokens are selected.
        blend_selection: how they are selected (``kvstore.blend.selection.SelectionPolicy``): ``kv_deviation``
            (CacheBlend's), ``query_attention`` (what the prompt's question attends to; the pass then computes the
            question up to the check layer), ``chunk_start`` or span starts plus either.
        blend_chunk_start_tokens: first tokens of every reused span the ``chunk_start`` policies take.
        blend_disk_policy: chunks only the disk holds: ``auto`` computes them when that is expected to be faster
            than reading them, ``wait`` always reads them, ``recompute`` never waits for the disk.
        blend_passes_per_step: the most blend passes one engine step runs. A pass runs inside the step, before its
            forward, so every request decoding in that step waits for all of them; a request over the bound waits
            for a later step (vLLM asks again), not for a plain prefill.
        blend_gate: blend a span only when the gate expects the pass to beat vLLM's prefill of it (on by default);
            off blends every span found, as measurements of blending itself need when another load shares the
            machine and the gate's learnt rates follow it.
    """

    url: str | None = None
    embedded: EmbeddedServerSettings = EmbeddedServerSettings()
    model_id: str | None = None
    lookup_timeout_s: float = 2.0
    transfer_timeout_s: float = 30.0
    retry_s: float = 5.0
    async_disk_loads: bool = True
    blend: bool = False
    blend_ratio: float = 0.15
    blend_check_layer: int = 1
    blend_selection: str = "kv_deviation"
    blend_chunk_start_tokens: int = 4
    blend_disk_policy: str = "auto"
    blend_passes_per_step: int = 1
    blend_gate: bool = True


def default_engine_data_dir(layout: KVLayout) -> Path:
    """The embedded server's data dir when ``kvstore.data_dir`` is not given: one per layout, under
    ``./kvstore-data``, named after the model's last path component, its KV dtype and the layout's namespace.

    One per layout because a data dir holds one layout: with a single ``./kvstore-data``, an engine of another model
    or dtype than the one already cached there (the README's samples store SmolLM2 in bfloat16; docs/vllm.md's
    engine runs it in float32) was refused at start. ``kvstore serve``'s own ``./kvstore-data`` is left to it.
    """
    leaf = layout.model_id.rstrip("/").rsplit("/", 1)[-1]
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", leaf).strip("-.")[:64] or "model"
    return DEFAULT_DATA_DIR / f"{name}-{layout.dtype.value}-{layout.namespace.hex()[:8]}"


def settle_data_dir(settings: ConnectorSettings, layout: KVLayout) -> ConnectorSettings:
    """``settings`` with the embedded server's data dir given: ``kvstore.data_dir``, else the layout's default."""
    if settings.embedded.data_dir is not None:
        return settings
    return replace(settings, embedded=replace(settings.embedded, data_dir=default_engine_data_dir(layout)))


_PASSED_AS_THEY_ARE = tuple(
    field.name
    for field in fields(EmbeddedServerSettings)
    if field.name not in ("data_dir", "chunk_separator", "enable_blend")
)
"""The embedded settings passed as ``kvstore serve --NAME VALUE`` as they are: every field but the three that
``serve_flags`` writes itself (``tests/connectors/test_embedded_settings_declared.py`` checks each against
``kvstore serve``'s declaration, ``ServeFlags``)."""
_EMBEDDED_KEYS = {field.name: field.type for field in fields(EmbeddedServerSettings) if field.name != "enable_blend"}
_TOP_KEYS = {field.name: field.type for field in fields(ConnectorSettings) if field.name != "embedded"}
_TIMEOUTS = ("lookup_timeout_s", "transfer_timeout_s", "retry_s")
_SIZES = ("cpu_size", "gpu_size", "disk_size")


def parse_connector_settings(extra_config: Mapping[str, object] | None) -> ConnectorSettings:
    """Parse the ``kvstore.*`` keys of a connector config.

    Raises:
        ConfigError: an unknown key, a wrong type, a value out of range, or an embedded-server key next to
            ``kvstore.url``.
    """
    top: dict[str, object] = {}
    embedded: dict[str, object] = {}
    for raw_key, value in (extra_config or {}).items():
        key = str(raw_key)
        name = key.removeprefix(_PREFIX)
        if not key.startswith(_PREFIX) or (name not in _TOP_KEYS and name not in _EMBEDDED_KEYS):
            known = ", ".join(_PREFIX + known_name for known_name in sorted({*_TOP_KEYS, *_EMBEDDED_KEYS}))
            raise ConfigError(f"unknown kvstore connector setting {key!r}; known settings: {known}")
        (top if name in _TOP_KEYS else embedded)[name] = _checked(key, name, value)
    if top.get("url") is not None and embedded:
        names = ", ".join(_PREFIX + name for name in sorted(embedded))
        raise ConfigError(
            f"{names} configure the embedded server and cannot go with kvstore.url; set them where that server runs"
        )
    embedded["enable_blend"] = bool(top.get("blend", False))
    return ConnectorSettings(embedded=EmbeddedServerSettings(**embedded), **top)  # type: ignore[arg-type]


def _checked(key: str, name: str, value: object) -> object:
    """The value converted to the setting's type, or one line saying what is wrong."""
    if name in ("url", "model_id", "tiers", "remote_url", "remote_namespace", "kv_events", "kv_events_replay"):
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{key} must be a non-empty string, not {value!r}")
        if name == "url":
            try:
                check_server_url(value)
            except ConfigError as exc:
                raise ConfigError(f"{key}: {exc}") from None
        return value
    if name in ("data_dir", "config"):
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{key} must be a path string, not {value!r}")
        return Path(value)
    if name == "blend_ratio":
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
            raise ConfigError(f"{key} must be a fraction in [0, 1] (0.15 is CacheBlend's default), not {value!r}")
        return float(value)
    if name == "blend_check_layer":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{key} must be a layer index >= 0 (default 1), not {value!r}")
        return value
    if name == "blend_selection":
        if value not in BLEND_SELECTIONS:
            raise ConfigError(f"{key} must be one of {', '.join(BLEND_SELECTIONS)}, not {value!r}")
        return value
    if name == "blend_chunk_start_tokens":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key} must be a token count >= 1 (default 4), not {value!r}")
        return value
    if name == "blend_passes_per_step":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key} must be a number of passes >= 1 (default 1), not {value!r}")
        return value
    if name == "blend_disk_policy":
        if value not in BLEND_DISK_POLICIES:
            raise ConfigError(f"{key} must be one of {', '.join(BLEND_DISK_POLICIES)}, not {value!r}")
        return value
    if name in ("async_disk_loads", "blend", "blend_gate"):
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, not {value!r}")
        return value
    if name == "chunk_separator":
        if isinstance(value, str) and value:
            return value
        try:
            separator = check_chunk_separator(value)
        except ConfigError:
            separator = ()
        if not separator:
            raise ConfigError(
                f'{key} must be a non-empty string (e.g. "\\n\\n", tokenized with the engine\'s tokenizer) or a list '
                f"of token ids, not {value!r}"
            )
        return separator
    if name == "chunking":
        try:
            return parse_chunking(value).value
        except ConfigError:
            raise ConfigError(f"{key} must be one of fixed, content; not {value!r}") from None
    if name == "chunk_size":
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{key} must be a positive integer, not {value!r}")
        return value
    if name in _SIZES:
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise ConfigError(f'{key} must be a size such as "8GiB", not {value!r}')
        try:
            parse_size(str(value))
        except ConfigError:
            raise ConfigError(f'{key}={value!r} is not a size; write e.g. "8GiB", "512MiB" or "2GB"') from None
        return str(value)
    assert name in _TIMEOUTS, f"setting {name} has no check"
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ConfigError(f"{key} must be a positive, finite number, not {value!r}")
    return float(value)
