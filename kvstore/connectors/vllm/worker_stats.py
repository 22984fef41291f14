"""``WorkerStats``: a worker's transfer counters, added to from the engine's thread and the transfer threads.

The engine's thread (sync loads, blend passes, its time in the hooks), the async-load thread and the save thread
each count what they moved; vLLM takes the counters on the engine's thread once a step. One lock guards the
counters and nothing else.
"""

from __future__ import annotations

import threading

from kvstore.connectors.vllm.metadata import KVStoreConnectorStats

__all__ = ["WorkerStats"]


class WorkerStats:
    """Counters since the last ``take`` (``KVStoreConnectorStats`` names them)."""

    def __init__(self) -> None:
        self._stats_lock = threading.Lock()
        self._stats = KVStoreConnectorStats()

    def record(self, **amounts: float) -> None:
        with self._stats_lock:
            self._stats.record(**amounts)

    def take(self) -> KVStoreConnectorStats | None:
        """The counters since the last call, reset (``None``: nothing worth reporting)."""
        with self._stats_lock:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, KVStoreConnectorStats()
        return stats
