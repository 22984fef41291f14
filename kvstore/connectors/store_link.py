"""An engine's link to its store: a ``Client`` that turns an outage into "no cache" instead of a failed request.

An engine must never fail or stall a request because the store is down, slow or restarting. ``StoreLink.call``
runs one operation and returns ``None`` when the store cannot answer; after a failure the link stays down for
``retry_s`` (calls return ``None`` at once, no timeout paid per request), then tries again: it reconnects, and for
the embedded default it first makes sure a server runs (starting a new one if the old one died). An outage is
logged once when it starts and once when it ends, whatever the number of failed calls in between.

Every store error counts as an outage (a server bug answering "internal error" must not fail requests either);
only ``LayoutMismatchError`` and a refused embedded server at ``connect`` raise, because no retry can fix a store
that serves another model.

``connect_links`` connects an engine process's links at once, so a store that does not answer costs engine start one
connect timeout (at most ``lookup_timeout_s``), not one per link.

Threads: one link may be used by several threads; calls are serialised by the ``Client``, state changes by a lock.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvstore.client import Client
from kvstore.connectors.embedded_server import EmbeddedServer, ensure_embedded_server
from kvstore.connectors.settings import ConnectorSettings
from kvstore.data_dir.server_record import live_server_record
from kvstore.errors import (
    KVStoreError,
    LayoutMismatchError,
    ProtocolError,
    ServerBusyError,
    ServerUnavailableError,
    StorageError,
)
from kvstore.layout import KVLayout

__all__ = ["StoreLink", "connect_links"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_OUTAGE_ERRORS = (ServerUnavailableError, ServerBusyError, ProtocolError, StorageError)


class StoreLink:
    """A ``Client`` to the connector's store that reports outages as ``None``.

    Args:
        settings: where the store is (a URL, or the embedded server's data dir).
        layout: the engine model's KV layout (the server refuses another).
        name: the client name the server shows (``kvstore inspect --url``) and labels metrics with.
        timeout_s: how long one call may wait for a reply.
    """

    def __init__(self, settings: ConnectorSettings, layout: KVLayout, *, name: str, timeout_s: float) -> None:
        self._settings = settings
        self._layout = layout
        self._name = name
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._client: Client | None = None
        self._server: EmbeddedServer | None = None  # the embedded server in use (``owned`` when this process's)
        self._starting: threading.Thread | None = None
        self._down_until = 0.0
        self._outage_started: float | None = None
        self._closed = False

    @property
    def url(self) -> str | None:
        return self._client.url if self._client is not None else self._settings.url

    def current_client(self) -> Client | None:
        """The connected client when the link is up, without any I/O (``None`` when down or not connected yet):
        for an engine thread, which must not wait on the store."""
        with self._lock:
            if self._closed or time.monotonic() < self._down_until:
                return None
            return self._client

    @property
    def is_up(self) -> bool:
        """Whether the last call reached the store."""
        return self._outage_started is None

    def connect(self) -> bool:
        """Connect now, at engine start (starting the embedded server here, not on a background thread): whether
        the store answered.

        Raises:
            LayoutMismatchError: the store serves another model's layout.
            ConfigError: the embedded server refused its settings.
        """
        try:
            if self._settings.url is None:
                self._ensure_server()
        except LayoutMismatchError:
            raise
        except KVStoreError as exc:
            if not isinstance(exc, _OUTAGE_ERRORS):
                with self._lock:
                    self._down_locked("connect", exc)
                raise
        return self.call("connect", lambda client: True, raise_layout_errors=True) is not None

    def call(self, what: str, operation: Callable[[Client], T], *, raise_layout_errors: bool = False) -> T | None:
        """``operation(client)``, or ``None`` when the store is down (or was down less than ``retry_s`` ago)."""
        client = self._client_or_none(what, raise_layout_errors)
        if client is None:
            return None
        try:
            result = operation(client)
        except KVStoreError as exc:
            self._mark_down(what, exc, client)
            return None
        self._mark_up(client)
        return result

    def _client_or_none(self, what: str, raise_layout_errors: bool) -> Client | None:
        with self._lock:
            if self._closed or time.monotonic() < self._down_until:
                return None
            stale = self._client if self._client is not None and self._server_exited_locked() else None
            if stale is not None:
                self._client = None  # connected to an embedded server that has exited: find its successor below
            elif self._client is not None:
                return self._client
        if stale is not None:
            stale.close(goodbye=False)
        with self._lock:
            if self._closed:
                return None
            if self._client is not None:
                return self._client
            url = self._settings.url
            server_pid = None
            if url is None:
                server = self._server
                if server is None or not server.is_running():
                    server = self._running_server_locked()
                if server is None:
                    self._start_in_background_locked()
                    if stale is not None:  # no retry_s wait: a link finds the new server as soon as it runs
                        exited = ServerUnavailableError(f"the embedded kvstore server at {stale.url} has exited")
                        self._note_outage_locked(what, exited)
                    return None
                url, server_pid = server.url, server.pid  # its death then fails a call at once
        try:  # outside the lock: a hello to a dead server must not block the link's other threads
            client = Client(
                url,
                self._layout,
                timeout_s=self._timeout_s,
                connect_timeout_s=min(self._timeout_s, self._settings.lookup_timeout_s),  # a hello is quick
                name=self._name,
                server_pid=server_pid,
            )
        except LayoutMismatchError as exc:
            if raise_layout_errors:
                raise
            with self._lock:
                self._down_locked(what, exc)
            return None
        except KVStoreError as exc:
            with self._lock:
                self._down_locked(what, exc)
            return None
        with self._lock:
            if self._client is None and not self._closed:
                self._client = client
                return client
            spare = self._client
        client.close()
        return spare

    def _server_exited_locked(self) -> bool:
        """Whether the link's embedded server is known to have exited (one procfs read): a link that was idle while
        the server died and another took its place would otherwise fail its first call, a load the scheduler
        planned on the new server."""
        return self._settings.url is None and self._server is not None and not self._server.is_running()

    def _running_server_locked(self) -> EmbeddedServer | None:
        """The server another process runs on the data dir (one file read), kept as the link's server."""
        record = live_server_record(self._settings.embedded.settled_data_dir)
        if record is None:
            return None
        self._server = EmbeddedServer(url=record.url, pid=record.pid)
        return self._server

    def _start_in_background_locked(self) -> None:
        """Find or start the embedded server on a thread of its own: no request waits for a server's start-up."""
        if self._starting is not None and self._starting.is_alive():
            return

        def start() -> None:
            try:
                self._ensure_server()
            except KVStoreError as exc:
                with self._lock:
                    self._down_locked("start the embedded server", exc)

        self._starting = threading.Thread(target=start, name="kvstore-embedded-start", daemon=True)
        self._starting.start()

    def _ensure_server(self) -> None:
        """Find the data dir's server, or start one; keep our own while it runs (only we may stop it)."""
        with self._lock:
            ours = self._server if self._server is not None and self._server.owned else None
        if ours is not None and ours.is_running():
            return
        server = ensure_embedded_server(self._settings.embedded)
        with self._lock:
            if self._closed:
                server.stop()
                return
            self._server = server

    def _mark_down(self, what: str, exc: Exception, client: Client) -> None:
        with self._lock:
            failed = self._client is client
            if failed:
                self._client = None
            self._down_locked(what, exc)
        if failed:  # outside the lock, and no goodbye to a server that does not answer
            client.close(goodbye=not isinstance(exc, ServerUnavailableError))

    def _down_locked(self, what: str, exc: Exception) -> None:
        self._down_until = time.monotonic() + self._settings.retry_s
        self._note_outage_locked(what, exc)

    def _note_outage_locked(self, what: str, exc: Exception) -> None:
        """Log the start of an outage (once: the next success logs its end)."""
        if self._outage_started is None:
            self._outage_started = time.monotonic()
            logger.warning(
                "kvstore store unavailable (%s: %s); serving without the cache, retrying every %.0f s",
                what,
                exc,
                self._settings.retry_s,
            )

    def _mark_up(self, client: Client) -> None:
        if self._outage_started is None:
            return
        with self._lock:
            if self._outage_started is not None:
                logger.warning(
                    "kvstore store at %s is back after %.1f s", client.url, time.monotonic() - self._outage_started
                )
                self._outage_started = None

    def close(self) -> None:
        """Say goodbye, and ask the embedded server to stop if this process started it. Idempotent.

        Nothing here waits for the store: vLLM gives an engine's processes a bounded time to exit before it kills
        them, so the server flushes its disk writes on its own after the engine is gone (a later engine on the data
        dir waits for that), and a start in flight on the background thread stops the server it started itself
        (its ``closed`` check) instead of being joined.
        """
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
            server, self._server = self._server, None
        if client is not None:
            client.close()
        if server is not None:
            server.stop()


def connect_links(
    settings: ConnectorSettings, layout: KVLayout, names: Sequence[str], *, timeout_s: float
) -> tuple[tuple[StoreLink, ...], bool]:
    """One link per name, each of which has tried the store once (``connect``), all at the same time: an engine
    process's start waits for one hello to a store that does not answer, not one per link (a worker holds three
    links, and each hello to a store that does not answer waits out its timeout).

    Args:
        settings: where the store is.
        layout: the engine model's KV layout.
        names: the links' client names.
        timeout_s: each link's call timeout.

    Returns:
        The links, in ``names`` order, and whether every one reached the store.

    Raises:
        LayoutMismatchError: the store serves another model's layout (every link is closed).
        ConfigError: the embedded server refused its settings (every link is closed).
    """
    links = tuple(StoreLink(settings, layout, name=name, timeout_s=timeout_s) for name in names)
    with concurrent.futures.ThreadPoolExecutor(len(links), thread_name_prefix="kvstore-connect") as pool:
        attempts = [pool.submit(link.connect) for link in links]
        concurrent.futures.wait(attempts)
    failure = next((attempt.exception() for attempt in attempts if attempt.exception() is not None), None)
    if failure is not None:
        for link in links:
            link.close()
        if isinstance(failure, LayoutMismatchError):
            raise LayoutMismatchError(_layout_refusal(settings, str(failure))) from None
        raise failure
    return links, all(attempt.result() for attempt in attempts)


def _layout_refusal(settings: ConnectorSettings, server_message: str) -> str:
    """The server's refusal of the engine's layout (what it holds, what the engine registered) with the setting that
    fixes it for a connector: the server's own advice names ``kvstore serve`` flags a connector user does not have."""
    facts = server_message.split("; ", 1)[0]
    if settings.url is not None:
        return (
            f"{facts}; point kvstore.url at a kvstore serve of this model (one server holds one model's KV: start "
            "another with its own --port and --data-dir)"
        )
    return (
        f"{facts}; the embedded server's data dir {settings.embedded.settled_data_dir} holds that model: set "
        "kvstore.data_dir to another dir for this engine"
    )
