"""A data dir that a running ``kvstore serve`` has not opened yet is still its own: an embedded store refuses it.

A server without ``--layout`` opens its data dir when the first client names the layout. Before that the dir's lock
is free, and a ``TieredStore`` on it used to take it and write there (the README's first sample, run while
``make run`` served), after which the server refused every client.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstore import Client, StoreConfig, TieredStore
from kvstore.errors import StorageError
from tests.server.conftest import SERVER_LAYOUT, running_server


def test_an_embedded_store_refuses_a_dir_a_server_will_open(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with running_server(data_dir, layout=None) as server:
        with pytest.raises(StorageError) as refused:
            TieredStore(SERVER_LAYOUT, StoreConfig(tiers=("cpu", "disk"), data_dir=data_dir))
        message = str(refused.value)
        assert "\n" not in message and f"pid {server.pid}" in message and server.url in message, message
        assert not (data_dir / "data.mdb").exists()  # nothing was written behind the server's back

        tokens = list(range(16))
        kv = torch.randn(SERVER_LAYOUT.chunk_shape(16)).to(torch.bfloat16)
        with Client(server.url, SERVER_LAYOUT) as client:  # the server still opens it for its first client
            client.store(tokens, kv, durable=True)
            assert client.lookup(tokens).num_prefix_tokens == 16


def test_the_dir_is_free_again_once_the_server_is_gone(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with running_server(data_dir, layout=None):
        pass
    with TieredStore(SERVER_LAYOUT, StoreConfig(tiers=("cpu", "disk"), data_dir=data_dir)) as store:
        assert store.layout == SERVER_LAYOUT
