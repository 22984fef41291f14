"""An embedded server left running from an earlier start with another cut is refused in one line, not reused: its
chunks would not be the ones the engine's settings ask for (``kvstore.chunk_separator``, ``kvstore.chunking``)."""

from __future__ import annotations

from contextlib import closing
from dataclasses import replace
from pathlib import Path

import pytest

from kvstore.connectors.settings import ConnectorSettings, EmbeddedServerSettings
from kvstore.connectors.store_link import StoreLink
from kvstore.connectors.vllm.connector import _require_chunk_cut
from tests.server.conftest import SERVER_LAYOUT, running_server


def _embedded(data_dir: Path, **given: object) -> ConnectorSettings:
    return ConnectorSettings(embedded=EmbeddedServerSettings(data_dir=data_dir, **given))  # type: ignore[arg-type]


@pytest.mark.timeout(120)
def test_a_running_server_that_cuts_by_another_rule_is_refused_in_one_line(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with running_server(data_dir, "--chunking", "content", "--chunk-size", "64") as server:

        def link() -> closing[StoreLink]:
            return closing(StoreLink(ConnectorSettings(url=server.url), SERVER_LAYOUT, name="test", timeout_s=10.0))

        for agreeing in (_embedded(data_dir), _embedded(data_dir, chunking="content")):
            with link() as held:
                _require_chunk_cut(held, agreeing)
        with link() as held, pytest.raises(ValueError) as refused:
            _require_chunk_cut(held, _embedded(data_dir, chunking="fixed"))
        message = str(refused.value)
        assert "\n" not in message
        assert f"server on {data_dir} cuts chunks by the content rule, not kvstore.chunking's fixed" in message
        with link() as held, pytest.raises(ValueError, match=r"after separator \[\], not kvstore.chunk_separator"):
            _require_chunk_cut(held, _embedded(data_dir, chunk_separator=(7, 7)))
        shared = replace(_embedded(data_dir, chunking="fixed"), url=server.url)
        with link() as held:
            _require_chunk_cut(held, shared)  # a shared server's own flags rule
