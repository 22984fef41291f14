"""The server's one ``TieredStore``, and the rule that decides its layout.

One server serves exactly one ``KVLayout`` (one model). Why not one store per layout: a data dir records one
layout and chunk size and is locked by one process, and the memory budgets (``--cpu-size``...) are per
process; several models on one host run several servers (another ``--port`` and ``--data-dir`` each), which
keeps every budget, data dir and metric attributable to one model.

The layout is fixed, in this order, by ``--layout``, by the layout the data dir recorded when it was created, or
else by the first client that registers one (logged at INFO). Until then the store is not open: admin requests
are answered, KV requests get a ``config`` error. A client whose layout differs from the server's gets
``layout_mismatch`` naming both.

The server keeps its cpu tier in shared memory (``StoreConfig.cpu_shared_memory``) whatever its configuration says:
clients on its host then copy hits straight from the tier's slots (``Op.LEND``) rather than through a copy of the
server's. Where the tier is page-locked (CUDA hosts) or the host has no memfds it stays as it was.

Threads: any. ``_open_lock`` serialises opening the store; once open, ``store`` is read without a lock (the
reference is set once).
"""

from __future__ import annotations

import dataclasses
import logging
import threading

from kvstore.config import StoreConfig
from kvstore.content.index import compile_kernels
from kvstore.errors import ConfigError, LayoutMismatchError
from kvstore.layout import KVLayout
from kvstore.store import TieredStore
from kvstore.tiers.base import TierName
from kvstore.wire.values import TierCapacity

__all__ = ["StoreHost"]

logger = logging.getLogger(__name__)


class StoreHost:
    """Opens and owns the server's store.

    Args:
        config: the store's settings (from ``kvstore serve``'s flags and config file).
        layout: the layout to open with now, or ``None`` to wait for the first client's.
    """

    def __init__(self, config: StoreConfig, layout: KVLayout | None) -> None:
        self.config = dataclasses.replace(config, cpu_shared_memory=True)
        self._open_lock = threading.Lock()
        self._store: TieredStore | None = None
        self._refused_layouts: set[bytes] = set()  # guarded by _open_lock: each refused layout is logged once
        if config.enable_blend:  # before the server answers anyone: a client's first content lookup has a timeout
            compile_kernels(config.chunk_size)
        if layout is not None:
            self._store = TieredStore(layout, self.config)

    @property
    def store(self) -> TieredStore | None:
        return self._store

    @property
    def layout(self) -> KVLayout | None:
        store = self._store
        return store.layout if store is not None else None

    def register(self, layout: KVLayout) -> TieredStore:
        """The store for a client's layout: opened with it when no layout is fixed yet.

        Raises:
            LayoutMismatchError: the server holds another layout.
            ConfigError: the layout does not fit the tiers (a chunk larger than a tier).
        """
        with self._open_lock:
            if self._store is None:
                try:
                    self._store = TieredStore(layout, self.config)
                except ConfigError as exc:  # the client hears it; the operator must too
                    if layout.namespace not in self._refused_layouts:
                        self._refused_layouts.add(layout.namespace)
                        logger.warning("refused a client's layout %s: %s", layout.describe(), exc)
                    raise
                logger.info("layout set by the first client: %s", layout.describe())
            store = self._store
        if store.layout.namespace != layout.namespace:
            raise LayoutMismatchError(
                f"this server holds KV of {store.layout.describe()}, the client registered {layout.describe()}; "
                "start another server (its own --port and --data-dir) for this model"
            )
        return store

    def require(self) -> TieredStore:
        """The store, for requests that need one.

        Raises:
            ConfigError: no layout is registered yet, so nothing is stored.
        """
        store = self._store
        if store is None:
            raise ConfigError(
                "no layout is registered on this server yet (no client has said hello with one, and it was started "
                "without --layout on an empty data dir): nothing is stored"
            )
        return store

    def tier_capacities(self) -> tuple[TierCapacity, ...]:
        """Each tier's capacity: the real one once the store is open, the configured one before."""
        store = self._store
        if store is not None:
            return tuple(TierCapacity(tier=t.tier, capacity_bytes=t.capacity_bytes) for t in store.stats().tiers)
        configured = {
            TierName.GPU: self.config.gpu_capacity_bytes,
            TierName.CPU: self.config.cpu_capacity_bytes,
            TierName.DISK: self.config.disk_capacity_bytes,
            TierName.REMOTE: 0,  # Valkey's maxmemory, not ours
        }
        return tuple(TierCapacity(tier=tier, capacity_bytes=configured[tier]) for tier in self.config.tiers)

    def close(self) -> None:
        """Close the store: release pins, finish registrations, flush and sync pending disk writes."""
        with self._open_lock:
            store = self._store
        if store is not None:
            store.close()  # later requests get StoreClosedError: a ``shutting_down`` reply
