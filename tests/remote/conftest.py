"""Real ``valkey-server`` processes for the remote tier's tests (``kvstore.bench.valkey_server`` launches one,
``tests.harness.valkey_cluster`` a cluster of them)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.bench.valkey_server import ValkeyServer
from tests.harness.valkey_cluster import ValkeyCluster


@pytest.fixture
def valkey(tmp_path: Path) -> Iterator[ValkeyServer]:
    """A fresh server per test (about 0.1 s to start): tests may crash, pause or fill it."""
    with ValkeyServer(tmp_path / "valkey") as server:
        yield server


@pytest.fixture(scope="module")
def _valkey_cluster_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyCluster]:
    """One 3-master cluster per module: a cluster takes about 2 s to report ok (Valkey's writable delay)."""
    with ValkeyCluster(tmp_path_factory.mktemp("valkey-cluster"), num_masters=3) as cluster:
        yield cluster


@pytest.fixture
def valkey_cluster(_valkey_cluster_module: ValkeyCluster) -> ValkeyCluster:
    """The module's cluster, emptied first (FLUSHALL on every master) so that no test sees another's keys.

    Shared, so a test must not kill, pause or stop its nodes: one that needs to builds a ValkeyCluster of its own.
    """
    for node in _valkey_cluster_module.nodes:
        with node.client() as client:
            client.flushall()
    return _valkey_cluster_module
