"""``kvstore serve --chunking``: a flag, variable or config key like every setting, adopted from the data dir when not
given, and refused in one line when it disagrees with the chunks the data dir holds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore import Client, StoreConfig, TieredStore
from kvstore.chunking import Chunking, ContentCutShape
from kvstore.cli.serve import startup_lines
from kvstore.config import GIB
from kvstore.content.partials import MIN_PARTIAL_TOKENS
from kvstore.content_cut import content_cuts
from kvstore.errors import ConfigError, LayoutMismatchError
from kvstore.keys import as_token_array
from kvstore.server.app import ServerAddress
from kvstore.server.host_facts import HostFacts
from kvstore.server.serve_flags import check_flags
from kvstore.server.serve_sources import ServeFlags
from kvstore.server.settings import resolve_settings
from kvstore.tiers.base import TierName
from tests.factories import make_kv, make_tokens
from tests.server.conftest import CHUNK_SIZE, SERVER_LAYOUT, running_server

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


@pytest.mark.slow
def test_a_server_cutting_by_content_says_so_and_finds_a_moved_document(tmp_path: Path) -> None:
    """The hello names the rule (what a connector checks a running server against); a document stored through the
    server alone is found after other tokens, its chunks cut by the server as the store cuts them. One stored behind
    a template and before a question is found to its ends in other surroundings: its head and tail travel as slices
    of the stored chunks (rows and chunk lengths beside the segment rows), each token its stored row; a client that
    does not read slices (one from before them) is sent none."""
    chunk_size = 64  # slices of at least MIN_PARTIAL_TOKENS fit in a chunk
    document = make_tokens(10 * chunk_size + 3, seed=61)
    kv = make_kv(SERVER_LAYOUT, len(document), seed=61)
    shape = ContentCutShape.for_chunk_size(chunk_size)
    synced = next(cut for cut in content_cuts(as_token_array(document), shape).tolist() if cut >= shape.sync_tokens)
    template, question = make_tokens(19, seed=63), make_tokens(40, seed=64)
    surrounded = np.concatenate([template, make_tokens(6 * chunk_size, seed=65), question])
    surrounded_kv = make_kv(SERVER_LAYOUT, len(surrounded), seed=66)
    with (
        running_server(tmp_path / "d", "--chunking", "content", "--enable-blend", "--chunk-size", str(chunk_size))
        as server,
        Client(server.url, SERVER_LAYOUT) as client,
    ):
        assert client.server.chunking is Chunking.CONTENT and client.server.partial_segments
        client.store(document, kv)
        query = np.concatenate([make_tokens(11, seed=62), document])
        result = client.retrieve(client.lookup(query))
        assert sum(segment.num_tokens for segment in result.segments) >= len(document) - synced
        for segment in result.segments:
            source = kv[:, :, segment.source_start : segment.source_start + segment.num_tokens]
            assert segment.start - segment.source_start == 11
            assert torch.equal(result.kv[:, :, segment.start : segment.end], source)

        client.store(surrounded, surrounded_kv)
        client.flush()
        moved = surrounded[len(template) : -len(question)]
        query = np.concatenate([make_tokens(30, seed=67), moved, make_tokens(25, seed=68)])
        plan = client.lookup(query)
        assert any(segment.is_slice for segment in plan.segments)
        served = np.zeros(len(query), dtype=bool)
        result = client.retrieve(plan)
        assert result.segments == plan.segments
        for segment in result.segments:
            source = surrounded_kv[:, :, segment.source_start : segment.source_start + segment.num_tokens]
            assert torch.equal(result.kv[:, :, segment.start : segment.end], source)
            served[segment.start : segment.end] = True
        assert served[30 + MIN_PARTIAL_TOKENS : 30 + len(moved) - MIN_PARTIAL_TOKENS].all()
        older = client.lookup(query, partial=False)
        assert not any(segment.is_slice for segment in older.segments)
        client.release(older)
