"""A whole server: wire the store, the client registry, the handler, the loop and the metrics endpoint; run; stop.

Start-up order puts every failure before the server announces itself: open the store (takes the data dir's lock,
recovers its index), bind the ZeroMQ port, bind the metrics port, write ``serve.json``, then call ``on_ready``.
Shutdown is the reverse and always completes: the loop finishes requests in flight, departed clients' plans are
released, sockets and the metrics endpoint close, the document hit counts are saved into the data dir (a failure is
logged, not raised), ``serve.json`` is removed, and the store is closed (pending disk writes committed and synced).

Threads: ``run_server`` runs the loop on the calling thread; see ``loop`` for the rest.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvstore.data_dir.server_record import (
    ServerRecord,
    live_server_record,
    remove_server_record,
    write_server_record,
)
from kvstore.errors import KVStoreError, ServerUnavailableError
from kvstore.server.clients import ClientRegistry
from kvstore.server.handlers import RequestHandler, ServerIdentity
from kvstore.server.host_facts import probe_host
from kvstore.server.kv_events.publisher import KVEventPublisher
from kvstore.server.loop import KVServer
from kvstore.server.metrics import MetricsServer, ServerMetrics
from kvstore.server.settings import ServeFlags, ServerSettings, resolve_settings
from kvstore.server.store_host import StoreHost
from kvstore.stats import StoreStats
from kvstore.tiers.base import TierName
from kvstore.version import __version__
from kvstore.wire.shm import host_id, shm_available

__all__ = ["ServerAddress", "background_server", "run_server", "server_version"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerAddress:
    """Where a started server listens, and what its disk tier recovered (``None``: no disk tier, or the store opens
    when the first client names the layout)."""

    url: str
    metrics_url: str
    disk_chunks: int | None = None


def server_version() -> str:
    return __version__


def run_server(settings: ServerSettings, stop: threading.Event, on_ready: Callable[[ServerAddress], None]) -> None:
    """Serve until ``stop`` is set; return once everything is flushed and closed.

    Raises:
        KVStoreError: start-up failed (the data dir is held, a port is taken, the layout does not fit).
    """
    config = settings.store
    started_s = time.monotonic()
    host = StoreHost(config, settings.layout)
    try:
        _serve(settings, host, started_s, stop, on_ready)
    finally:
        host.close()
        logger.info("server stopped after %.1f s", time.monotonic() - started_s)


def _serve(
    settings: ServerSettings,
    host: StoreHost,
    started_s: float,
    stop: threading.Event,
    on_ready: Callable[[ServerAddress], None],
) -> None:
    config = settings.store
    clients = ClientRegistry()

    def store_stats() -> StoreStats | None:
        store = host.store
        return store.stats() if store is not None else None

    metrics = ServerMetrics(store_stats, lambda: clients.num_clients)
    data_dir = config.data_dir if TierName.DISK in config.tiers else None
    identity = ServerIdentity(
        version=server_version(),
        host_id=host_id(),
        pid=os.getpid(),
        started_s=started_s,
        limits=settings.loop.limits,
        shm=shm_available(),
        data_dir=str(data_dir) if data_dir is not None else None,
    )
    serving = threading.Event()
    handler = RequestHandler(host, clients, identity, metrics, is_serving=serving.is_set)
    server = KVServer(handler, settings.loop)
    events: KVEventPublisher | None = None
    try:
        if settings.kv_events is not None:
            events = KVEventPublisher(settings.kv_events, lambda: host.store, config.chunk_size)
            metrics.watch_kv_events(events.stats)
        metrics_server = MetricsServer(settings.loop.host, settings.metrics_port, metrics, handler.health)
    except BaseException:
        if events is not None:
            events.close()
        server.close()
        raise
    metrics_url = f"http://{settings.loop.host}:{metrics_server.port}/metrics"
    stats = store_stats()
    disk = stats.tier(TierName.DISK) if stats is not None else None
    address = ServerAddress(
        url=server.url, metrics_url=metrics_url, disk_chunks=disk.num_chunks if disk is not None else None
    )
    record_dir = _record_dir(config.data_dir, data_dir)
    try:
        metrics_server.start()
        if record_dir is not None:
            write_server_record(record_dir, ServerRecord(pid=os.getpid(), url=server.url, metrics_url=metrics_url))
        serving.set()
        logger.info("serving on %s (metrics %s)", server.url, metrics_url)
        on_ready(address)
        server.serve_forever(stop)
    finally:
        serving.clear()
        for departure in clients.remove_all():
            handler.give_back(departure)
        metrics_server.close()
        server.close()
        if events is not None:
            events.close()
        try:
            handler.save_document_hits()
        except KVStoreError as exc:  # shutdown must complete; the counts of the last minute are what is lost
            logger.error("document hit counts not saved at shutdown: %s", exc)
        if record_dir is not None:
            remove_server_record(record_dir)


def _record_dir(configured: Path, held: Path | None) -> Path | None:
    """Where this server records itself (``serve.json``): the data dir it holds (disk tier), else its configured
    data dir when that exists and no live server recorded itself there (the connector's embedded server, cpu
    tier only, is found there; a bare ``kvstore serve --tiers cpu`` creates no dir)."""
    if held is not None:
        return held
    if configured.is_dir() and live_server_record(configured) is None:
        return configured
    return None


@contextlib.contextmanager
def background_server(flags: ServeFlags, start_timeout_s: float = 120.0) -> Iterator[ServerAddress]:
    """A server on a thread of this process, for embedding and examples (``kvstore serve`` runs the same server
    in its own process, which is what production wants: its own GIL and a lifetime of its own).

    Example::

        with background_server(ServeFlags(tiers="cpu", port=0, metrics_port=0)) as address:
            with Client(address.url, layout) as client:
                ...

    Raises:
        KVStoreError: the settings are invalid or start-up failed.
        ServerUnavailableError: it did not start within ``start_timeout_s``.
    """
    settings = resolve_settings(flags, probe_host())
    stop, ready = threading.Event(), threading.Event()
    started: list[ServerAddress] = []
    failure: list[BaseException] = []

    def announce(address: ServerAddress) -> None:
        started.append(address)
        ready.set()

    def serve() -> None:
        try:
            run_server(settings, stop, announce)
        except BaseException as exc:  # the thread's boundary: hand start-up failures to the caller
            failure.append(exc)
            ready.set()

    thread = threading.Thread(target=serve, name="kvstore-background-server", daemon=True)
    thread.start()
    try:
        if not ready.wait(start_timeout_s):
            raise ServerUnavailableError(f"the background server did not start within {start_timeout_s:g} s")
        if failure:
            raise failure[0]
        yield started[0]
    finally:
        stop.set()
        thread.join()
