"""The client end of the wire: one DEALER socket, one request at a time, a deadline on every reply.

Why DEALER and not REQ: a REQ socket that timed out is stuck (it must receive before it may send again). With
DEALER each request carries an id; a reply to an older, timed-out request is recognised by its id and dropped.
After a timeout the socket is closed and reopened anyway (linger 0), so requests still queued for a dead server
do not reach its successor later.

ZeroMQ reconnects by itself; a server that restarted answers the next request with ``not_registered`` and the
client (``kvstore.Client``) says hello again.

Threads: not thread-safe; ``kvstore.Client`` serialises calls.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Mapping

import zmq

from kvstore.errors import ProtocolError, ServerUnavailableError
from kvstore.wire.address import check_server_url
from kvstore.wire.error_codes import RequestError
from kvstore.wire.protocol import Op, Reply, decode_reply, encode_request

__all__ = ["Connection"]

logger = logging.getLogger(__name__)

_ALIVE_CHECK_MS = 200


class Connection:
    """A request/reply channel to one server URL.

    Args:
        url: the server's ``tcp://host:port``.
        server_alive: when the server's process is known (same host), whether it still runs: a request to a
            server that has exited fails within 200 ms instead of waiting out its timeout.
    """

    def __init__(self, url: str, server_alive: Callable[[], bool] | None = None) -> None:
        self.url = check_server_url(url)
        self._server_alive = server_alive
        self._context = zmq.Context()
        self._socket: zmq.Socket[bytes] | None = None
        self._request_ids = itertools.count(1)
        self._open_socket()

    def _open_socket(self) -> None:
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RECONNECT_IVL, 100)
        socket.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        try:
            socket.connect(self.url)
        except zmq.ZMQError as exc:
            socket.close(linger=0)
            raise ServerUnavailableError(f"cannot connect to {self.url}: {exc.strerror}") from exc
        self._socket = socket

    def _reset(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
        self._open_socket()

    def request(
        self,
        op: Op,
        client_id: str | None,
        args: Mapping[str, object],
        payload: memoryview | None,
        timeout_s: float,
    ) -> Reply:
        """Send one request and wait for its reply.

        Raises:
            ServerUnavailableError: no reply within ``timeout_s``.
            ProtocolError: the reply is malformed.
        """
        socket = self._socket
        if socket is None:
            raise ServerUnavailableError(f"the connection to {self.url} is closed")
        request_id = next(self._request_ids)
        header = encode_request(request_id, op, client_id, args)
        frames: list[bytes | memoryview] = [header] if payload is None else [header, payload]
        deadline = time.monotonic() + timeout_s
        try:
            socket.send_multipart(frames, copy=payload is None)
            while True:
                remaining_ms = int((deadline - time.monotonic()) * 1000)
                if remaining_ms <= 0:
                    break
                if not socket.poll(min(remaining_ms, _ALIVE_CHECK_MS), zmq.POLLIN):
                    if self._server_alive is not None and not self._server_alive():
                        self._reset()
                        raise ServerUnavailableError(
                            f"the kvstore server at {self.url} has exited ({op.value} got no reply)"
                        )
                    continue
                parts = socket.recv_multipart(copy=False)
                try:
                    reply = decode_reply([part.buffer for part in parts])
                except RequestError as exc:
                    raise ProtocolError(f"malformed reply from {self.url}: {exc.message}") from None
                if reply.request_id == request_id:
                    return reply
                logger.debug("dropped a late reply (request %s) from %s", reply.request_id, self.url)
        except zmq.ZMQError as exc:
            self._reset()
            raise ServerUnavailableError(f"connection to {self.url} failed: {exc.strerror}") from exc
        self._reset()
        raise ServerUnavailableError(
            f"no reply from a kvstore server at {self.url} within {timeout_s:g} s ({op.value}); is `kvstore serve` "
            "running there (check the URL and port)?"
        )

    def close(self) -> None:
        """Close the socket. Idempotent."""
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        if not self._context.closed:
            self._context.term()
