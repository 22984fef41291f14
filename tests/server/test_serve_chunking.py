"""``kvstore serve --chunking``: a flag, variable or config key like every setting, adopted from the data dir when not
given, and refused in one line when it disagrees with the chunks the data dir holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore import StoreConfig, TieredStore
from kvstore.chunking import Chunking
from kvstore.cli.serve import startup_lines
from kvstore.config import GIB
from kvstore.errors import ConfigError, LayoutMismatchError
from kvstore.server.app import ServerAddress
from kvstore.server.host_facts import HostFacts
from kvstore.server.serve_flags import check_flags
from kvstore.server.serve_sources import ServeFlags
from kvstore.server.settings import resolve_settings
from kvstore.tiers.base import TierName
from tests.server.conftest import CHUNK_SIZE, SERVER_LAYOUT

MACHINE = HostFacts(cuda_available=False, available_memory_bytes=16 * GIB, gpu_free_bytes=0)
ADDRESS = ServerAddress(url="tcp://127.0.0.1:1", metrics_url="http://127.0.0.1:2/metrics", disk_chunks=0)


def test_the_rule_is_a_flag_a_variable_and_a_config_key(tmp_path: Path) -> None:
    data = tmp_path / "d"
    assert check_flags(ServeFlags(data_dir=data), environ={}).store.chunking is Chunking.FIXED
    assert check_flags(ServeFlags(data_dir=data, chunking="content"), environ={}).store.chunking is Chunking.CONTENT
    from_env = check_flags(ServeFlags(data_dir=data), environ={"KVSTORE_CHUNKING": "content"})
    assert from_env.store.chunking is Chunking.CONTENT and from_env.given_by["chunking"] == "KVSTORE_CHUNKING"
    config_file = tmp_path / "kvstore.toml"
    config_file.write_text('chunking = "content"\n')
    assert check_flags(ServeFlags(data_dir=data), config_file, environ={}).store.chunking is Chunking.CONTENT
    with pytest.raises(ConfigError, match=r"^chunking='rolling' must be one of fixed, content$"):
        check_flags(ServeFlags(data_dir=data, chunking="rolling"), environ={})
    with pytest.raises(ConfigError, match="needs chunk_size >= 16"):
        check_flags(ServeFlags(data_dir=data, chunking="content", chunk_size=8), environ={})


def test_a_data_dir_keeps_its_rule(tmp_path: Path) -> None:
    recorded = tmp_path / "recorded"
    config = StoreConfig(
        tiers=(TierName.DISK,), chunk_size=CHUNK_SIZE, data_dir=recorded, disk_capacity_bytes=1 << 26,
        chunking=Chunking.CONTENT,
    )  # fmt: skip
    TieredStore(SERVER_LAYOUT, config).close()
    adopted = resolve_settings(ServeFlags(data_dir=recorded), MACHINE, environ={})
    assert adopted.store.chunking is Chunking.CONTENT
    assert any("cut by content" in line for line in startup_lines(adopted, ADDRESS))
    agreed = resolve_settings(ServeFlags(data_dir=recorded, chunking="content"), MACHINE, environ={})
    assert agreed.store.chunking is Chunking.CONTENT
    with pytest.raises(LayoutMismatchError, match=r"--chunking fixed disagrees .* pass --chunking content"):
        resolve_settings(ServeFlags(data_dir=recorded, chunking="fixed"), MACHINE, environ={})
    fresh = resolve_settings(ServeFlags(data_dir=tmp_path / "fresh", chunking="content"), MACHINE, environ={})
    assert fresh.store.chunking is Chunking.CONTENT
