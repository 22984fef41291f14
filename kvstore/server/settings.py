"""``kvstore serve``'s settings, completed and checked against this machine and the data dir before anything starts.

``kvstore.server.serve_flags`` merges flags over ``KVSTORE_*`` environment variables over a TOML config file and
checks everything that needs no host facts, LMDB or ``KVLayout`` (without importing torch: a bad flag is refused at
once); ``resolve_settings`` runs it and checks the rest, each failure one line (``ConfigError`` /
``LayoutMismatchError``):
- tiers: gpu only with CUDA;
- the data dir: a ``--chunk-size`` or ``--layout`` that disagrees with what it recorded;
- sizes: a cpu tier larger than the available RAM, a gpu tier larger than the free device memory, a disk tier
  larger than the free disk (plus what the data dir already holds); a tier smaller than one chunk of the layout.

Defaults serve out of the box: tiers gpu,cpu,disk with CUDA else cpu,disk; chunk size = the data dir's, else 256;
cpu 4 GiB (at most a quarter of the available RAM), gpu 4 GiB (at most a quarter of the free device memory), disk
64 GiB (at most half the free disk); ``./kvstore-data``; 127.0.0.1:5555, metrics on 5556.

Pure functions over a ``HostFacts`` value and an environment mapping (tests pass their own).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvstore.chunking import Chunking
from kvstore.config import StoreConfig
from kvstore.errors import ConfigError, LayoutMismatchError
from kvstore.layout import KVLayout
from kvstore.presets import PRESET_NAMES, preset_layout
from kvstore.server.host_facts import HostFacts, free_disk_bytes
from kvstore.server.kv_events.options import KVEventOptions
from kvstore.server.loop import LoopOptions
from kvstore.server.serve_flags import CheckedFlags, check_fits, check_flags, check_room_for_a_chunk
from kvstore.server.serve_sources import (
    ENV_PREFIX,
    NON_SETTING_VARIABLES,
    ServeFlags,
    env_name,
    flag_name,
    load_config_file,
    read_environment,
)
from kvstore.tiers.base import TierName
from kvstore.tiers.disk.layout_copy import recorded_chunking, recorded_layout

__all__ = [
    "ENV_PREFIX",
    "NON_SETTING_VARIABLES",
    "ServeFlags",
    "ServerSettings",
    "complete_settings",
    "env_name",
    "flag_name",
    "load_config_file",
    "read_environment",
    "resolve_settings",
]

_STORE_DEFAULTS = StoreConfig()  # the one source of the store's defaults; the host may lower the sizes
_DEFAULT_CHUNK_SIZE = _STORE_DEFAULTS.chunk_size
_DEFAULT_MEMORY_TIER_BYTES = _STORE_DEFAULTS.cpu_capacity_bytes
_DEFAULT_DISK_BYTES = _STORE_DEFAULTS.disk_capacity_bytes


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
    """``--layout``: a preset name (``llama3.1-8b``) or a JSON file holding ``KVLayout.to_json()`` (``check_flags``
    has refused anything else)."""
    if text in PRESET_NAMES:
        return preset_layout(text)
    path = Path(text)
    try:
        return KVLayout.from_json(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read --layout {path}: {exc.strerror}") from exc


def resolve_settings(
    flags: ServeFlags, host: HostFacts, config_file: Path | None = None, environ: Mapping[str, str] | None = None
) -> ServerSettings:
    """Merge flags, environment (``os.environ`` when ``None``), config file and defaults, and check them against this
    machine and the data dir: ``complete_settings(check_flags(...), host)``.

    Raises:
        ConfigError: an invalid or impossible setting (one line naming it and the fix).
        LayoutMismatchError: ``--layout``, ``--chunk-size`` or ``--chunking`` disagrees with the data dir.
        StorageError: a live server already holds the data dir.
    """
    return complete_settings(check_flags(flags, config_file, environ), host)


def complete_settings(checked: CheckedFlags, host: HostFacts) -> ServerSettings:
    """Decide what the host and the data dir decide (default tiers and sizes, the recorded layout and chunk size)
    and check it.

    Raises:
        ConfigError: gpu without CUDA, a size that does not fit, a tier too small for a chunk of the layout.
        LayoutMismatchError: ``--layout``, ``--chunk-size`` or ``--chunking`` disagrees with the data dir.
    """
    tiers = checked.tiers if checked.tiers is not None else _default_tiers(host)
    if TierName.GPU in tiers and not host.cuda_available:
        raise ConfigError("--tiers includes gpu, but torch sees no CUDA device; use --tiers cpu,disk")
    layout = read_layout_option(checked.layout) if checked.layout is not None else None
    data_dir = checked.store.data_dir
    chunk_size = checked.chunk_size
    if TierName.DISK in tiers:
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
        chunking = _recorded_chunking(checked, data_dir)
    else:
        chunking = checked.store.chunking
    sizes = _sizes(checked, tiers, host, data_dir)
    store = replace(
        checked.store,
        tiers=tiers,
        chunking=chunking,
        chunk_size=chunk_size if chunk_size is not None else _DEFAULT_CHUNK_SIZE,
        gpu_capacity_bytes=sizes.gpu_bytes,
        cpu_capacity_bytes=sizes.cpu_bytes,
        disk_capacity_bytes=sizes.disk_bytes,
    )
    chunk_bytes = layout.chunk_bytes(store.chunk_size) if layout is not None else None
    check_room_for_a_chunk(store, chunk_bytes, layout.describe() if layout is not None else None)
    loop = LoopOptions(
        host=checked.host,
        port=checked.port,
        num_control_workers=checked.num_workers,
        num_bulk_workers=checked.num_workers,
        plan_ttl_s=checked.plan_ttl_s,
    )
    return ServerSettings(
        store=store,
        layout=layout,
        loop=loop,
        metrics_port=checked.metrics_port,
        kv_events=checked.kv_events,
        given_by=checked.given_by,
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


def _sizes(checked: CheckedFlags, tiers: tuple[TierName, ...], host: HostFacts, data_dir: Path) -> _TierSizes:
    given = checked.sizes
    memory_default = min(_DEFAULT_MEMORY_TIER_BYTES, host.available_memory_bytes // 4)
    cpu_bytes = given.cpu_bytes if given.cpu_bytes is not None else memory_default
    gpu_default = min(_DEFAULT_MEMORY_TIER_BYTES, host.gpu_free_bytes // 4)
    gpu_bytes = given.gpu_bytes if given.gpu_bytes is not None else gpu_default
    if TierName.CPU in tiers:
        check_fits("cpu_size", cpu_bytes, host.available_memory_bytes, "RAM")
    if TierName.GPU in tiers:
        check_fits("gpu_size", gpu_bytes, host.gpu_free_bytes, "free GPU memory")
    disk_bytes = _DEFAULT_DISK_BYTES
    if TierName.DISK in tiers:
        free = free_disk_bytes(data_dir)
        disk_bytes = given.disk_bytes if given.disk_bytes is not None else min(_DEFAULT_DISK_BYTES, free // 2)
        check_fits("disk_size", disk_bytes, free, f"disk under {data_dir}")
    return _TierSizes(gpu_bytes=gpu_bytes, cpu_bytes=cpu_bytes, disk_bytes=disk_bytes)


def _recorded_chunking(checked: CheckedFlags, data_dir: Path) -> Chunking:
    """The cut rule: the data dir's when it recorded one (``--chunking`` must agree with it), else the given one.

    Raises:
        LayoutMismatchError: ``--chunking`` disagrees with the data dir's chunks.
    """
    recorded = recorded_chunking(data_dir)
    if recorded is None:
        return checked.store.chunking
    if checked.chunking is not None and checked.chunking is not recorded:
        raise LayoutMismatchError(
            f"--chunking {checked.chunking.value} disagrees with data dir {data_dir} (its chunks were cut by "
            f"{recorded.value}); pass --chunking {recorded.value} or use another --data-dir"
        )
    return recorded
