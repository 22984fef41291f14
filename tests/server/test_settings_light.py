"""``kvstore serve``'s light checks (``kvstore.server.serve_flags``, issue 45): importable without torch, numba or
LMDB; the floor a tier must clear when no layout is known (item 4); what a connecting ``--kv-events`` says at start
(item 10)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore import StoreConfig, TieredStore
from kvstore.cli.serve import startup_lines
from kvstore.config import GIB
from kvstore.errors import ConfigError
from kvstore.server.app import ServerAddress
from kvstore.server.host_facts import HostFacts
from kvstore.server.serve_flags import check_flags
from kvstore.server.serve_sources import ServeFlags
from kvstore.server.settings import resolve_settings
from kvstore.tiers.base import TierName
from tests.server.conftest import CHUNK_SIZE, REPO_ROOT, SERVER_LAYOUT

MACHINE = HostFacts(cuda_available=False, available_memory_bytes=16 * GIB, gpu_free_bytes=0)
ADDRESS = ServerAddress(url="tcp://127.0.0.1:1", metrics_url="http://127.0.0.1:2/metrics", disk_chunks=0)


def test_the_light_checks_import_no_torch_numba_or_lmdb() -> None:
    code = (
        "import json, sys\n"
        "import kvstore.server.serve_flags, kvstore.cli.serve, kvstore.cli.inspect, kvstore.cli.evict\n"
        "import kvstore.cli.demo, kvstore.cli.bench, kvstore.cli.server_probe, kvstore.config, kvstore.preset_names\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    loaded = set(json.loads(completed.stdout))
    heavy = {"torch", "numba", "lmdb", "zmq", "kvstore.layout", "kvstore.store", "kvstore.server.settings"}
    assert not heavy & loaded, heavy & loaded


def test_without_a_layout_a_tier_must_hold_a_chunk_of_the_smallest_preset(tmp_path: Path) -> None:
    data = tmp_path / "d"
    floor = 30 * 2 * 3 * 64 * 256  # SmolLM2-135M's 256-token chunk at one byte an element: 2.81 MiB
    fragment = r"--cpu-size 1KiB leaves .*\(smollm2-135m with fp8 KV: 256 tokens take 2\.81 MiB"
    with pytest.raises(ConfigError, match=fragment):
        check_flags(ServeFlags(data_dir=data, cpu_size="1KiB"), environ={})
    with pytest.raises(ConfigError, match="--disk-size"):
        check_flags(ServeFlags(data_dir=data, disk_size=str(floor - 1)), environ={})
    assert check_flags(ServeFlags(data_dir=data, cpu_size=str(floor)), environ={}).sizes.cpu_bytes == floor
    assert check_flags(ServeFlags(data_dir=data, tiers="disk", cpu_size="0"), environ={}), "no cpu tier: not checked"
    small_chunks = check_flags(ServeFlags(data_dir=data, cpu_size="200KiB", chunk_size=16), environ={})
    assert small_chunks.store.chunk_size == 16, "the floor is per chunk: 16 tokens take 180 KiB"


def test_a_named_or_recorded_layout_replaces_the_floor(tmp_path: Path) -> None:
    layout_file = tmp_path / "tiny.json"
    layout_file.write_text(SERVER_LAYOUT.to_json())
    flags = ServeFlags(data_dir=tmp_path / "d", cpu_size="64KiB", chunk_size=CHUNK_SIZE, layout=str(layout_file))
    assert resolve_settings(flags, MACHINE, environ={}).store.cpu_capacity_bytes == 64 << 10
    recorded = tmp_path / "recorded"
    config = StoreConfig(tiers=(TierName.DISK,), chunk_size=CHUNK_SIZE, data_dir=recorded, disk_capacity_bytes=1 << 26)
    TieredStore(SERVER_LAYOUT, config).close()
    settings = resolve_settings(ServeFlags(data_dir=recorded, cpu_size="64KiB"), MACHINE, environ={})
    assert settings.layout == SERVER_LAYOUT and settings.store.cpu_capacity_bytes == 64 << 10
    with pytest.raises(ConfigError, match="no room for one chunk"):
        resolve_settings(ServeFlags(data_dir=recorded, cpu_size="2KiB", disk_size="1MiB"), MACHINE, environ={})


def test_a_connecting_kv_events_endpoint_says_once_that_events_wait_for_a_subscriber(tmp_path: Path) -> None:
    connecting = resolve_settings(
        ServeFlags(data_dir=tmp_path / "d", kv_events="tcp://router:5557"), MACHINE, environ={}
    )
    lines = [line for line in startup_lines(connecting, ADDRESS) if "go nowhere" in line]
    assert lines == [
        "kv events: connecting to tcp://router:5557: events go nowhere until a subscriber (a router that binds) is "
        "listening there; tcp://*:PORT binds instead"
    ]
    binding = resolve_settings(ServeFlags(data_dir=tmp_path / "d", kv_events="tcp://*:5557"), MACHINE, environ={})
    assert not any("go nowhere" in line for line in startup_lines(binding, ADDRESS))
