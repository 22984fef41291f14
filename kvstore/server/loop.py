"""The serving loop: one I/O thread on a ZeroMQ ROUTER socket, two worker pools, a janitor.

    clients (DEALER) ---> ROUTER --(I/O thread: decode header, route)--> answered inline: health, lookup
          ^                 ^                                             (up to _MAX_INLINE_HEADER_BYTES)
          |                 |                                       --> control pool: hello, larger lookups,
          |                 |                                             release, end_session, stats, info, chunk,
          |                 |                                             attach, detach, goodbye, documents
          |                 |                                       --> bulk pool: store, retrieve, flush, evict
          +---- replies ----+<-- PULL (inproc) <-- PUSH (one per worker thread)

Why two pools: a retrieve that decodes chunks from disk, or a durable store waiting for fsync, takes
milliseconds to seconds; lookups and health checks must not queue behind them. Why replies go through an inproc
socket: ZeroMQ sockets are not thread-safe, so only the I/O thread touches the ROUTER, and a PULL socket wakes its
poll as soon as a worker pushes (no polling interval on the hot path).

Why health and lookups of prompts up to ~32K tokens are answered on the I/O thread: they are short, in-memory and
GIL-bound (the store holds its locks only for bookkeeping), so a worker could not run them any sooner, while the
hand-off to a worker and back (pool queue, thread wake-up, PUSH, PULL, two GIL hand-overs) costs a sizeable share of a
lookup round trip that must stay within its target (lookup p50 <= 1 ms; measured:
docs/design-notes.md#server-loop). A longer prompt's plan goes to the control pool, so one request never keeps the I/O
thread from receiving and forwarding for longer than a lookup's target. So does every release: its small header does
not say how many pins it drops (a 4M-token plan holds 16K).

Malformed requests (bad msgpack, wrong version, unknown op, bad header) are answered by the I/O thread itself;
when ``max_in_flight`` requests are being worked on, a new one is answered ``busy`` at once, which bounds memory
(at most ``max_in_flight`` payloads are held).

Shutdown (``stop`` event, set by SIGINT/SIGTERM): new requests get ``shutting_down``, requests in flight finish
and their replies are sent, then the pools and the janitor stop; the caller then closes the store, which flushes
and syncs pending disk writes.

Threads: the I/O thread (the caller of ``serve_forever``), ``kvstore-control-N`` and ``kvstore-bulk-N`` workers,
``kvstore-janitor``. ``_in_flight`` is touched only by the I/O thread; ``_push_sockets_lock`` guards the list of
worker PUSH sockets.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
from dataclasses import dataclass, field

import zmq

from kvstore.errors import ConfigError
from kvstore.server.handlers import ReplyFrames, RequestHandler
from kvstore.wire.error_codes import ErrorCode, RequestError
from kvstore.wire.protocol import Limits, Op, Request, decode_request

__all__ = ["KVServer", "LoopOptions"]

logger = logging.getLogger(__name__)

_BULK_OPS = frozenset({Op.STORE, Op.RETRIEVE, Op.FLUSH, Op.EVICT})
_INLINE_OPS = frozenset({Op.HEALTH, Op.LOOKUP})
_MAX_INLINE_HEADER_BYTES = 128 * 1024
"""A larger request (a lookup of over ~32K tokens, 4 bytes a token: a long plan) goes to the control pool."""
_POLL_MS = 200
_MAX_DRAIN = 256
_server_ids = itertools.count(1)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoopOptions:
    """How the loop serves.

    Args:
        host: interface to bind (``127.0.0.1``: this host only; ``0.0.0.0``: every interface).
        port: TCP port (0: any free port; read ``KVServer.url``).
        num_control_workers: threads for lookups and other quick operations.
        num_bulk_workers: threads for stores, retrieves, flushes and evictions.
        max_in_flight: requests worked on at once before new ones are answered ``busy``.
        plan_ttl_s: a plan neither retrieved nor released for this long is released by the janitor.
        janitor_interval_s: how often the janitor looks for dead clients and expired plans.
        limits: message sizes accepted.
    """

    host: str = "127.0.0.1"
    port: int = 5555
    num_control_workers: int = 4
    num_bulk_workers: int = 4
    max_in_flight: int = 256
    plan_ttl_s: float = 600.0
    janitor_interval_s: float = 1.0
    limits: Limits = field(default_factory=Limits)


class KVServer:
    """Binds the socket at construction (so a taken port fails before start-up) and serves until stopped.

    Args:
        handler: answers decoded requests.
        options: address, pools, limits.

    Raises:
        ConfigError: the address cannot be bound.
    """

    def __init__(self, handler: RequestHandler, options: LoopOptions) -> None:
        self._handler = handler
        self._options = options
        self._context = zmq.Context()
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        limits = options.limits
        # Frames over this are dropped by ZeroMQ with the connection (no reply possible); everything up to it is
        # read and answered, ``too_large`` included.
        self._router.setsockopt(zmq.MAXMSGSIZE, max(limits.max_header_bytes, limits.max_payload_bytes) + (1 << 20))
        try:
            if options.port == 0:
                port = self._router.bind_to_random_port(f"tcp://{options.host}")
            else:
                self._router.bind(f"tcp://{options.host}:{options.port}")
                port = options.port
        except zmq.ZMQError as exc:
            self._router.close()
            self._context.term()
            raise ConfigError(
                f"cannot listen on {options.host}:{options.port}: {exc.strerror}; pick another --port or --host"
            ) from exc
        self.url = f"tcp://{options.host}:{port}"
        self._replies_endpoint = f"inproc://kvstore-replies-{next(_server_ids)}"
        self._pull = self._context.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self._replies_endpoint)
        self._local = threading.local()
        self._push_sockets: list[zmq.Socket[bytes]] = []
        self._push_sockets_lock = threading.Lock()
        self._control = concurrent.futures.ThreadPoolExecutor(options.num_control_workers, "kvstore-control")
        self._bulk = concurrent.futures.ThreadPoolExecutor(options.num_bulk_workers, "kvstore-bulk")
        self._in_flight = 0
        self._stopping = threading.Event()
        self._janitor_stop = threading.Event()
        self._janitor = threading.Thread(target=self._janitor_loop, name="kvstore-janitor", daemon=True)

    @property
    def serving(self) -> bool:
        """``False`` once shutdown has begun."""
        return not self._stopping.is_set()

    def serve_forever(self, stop: threading.Event) -> None:
        """Answer requests until ``stop`` is set, then finish those in flight and stop the workers."""
        self._janitor.start()
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll(_POLL_MS))
                if self._pull in events:
                    self._forward_replies()
                if self._router in events:
                    self._accept_requests()
                if stop.is_set() and not self._stopping.is_set():
                    self._stopping.set()
                    logger.info("stopping: finishing %d requests in flight", self._in_flight)
                if self._stopping.is_set() and self._in_flight == 0:
                    break
        finally:
            self._shutdown_workers()

    # -- the I/O thread ----------------------------------------------------------------------------------------

    def _accept_requests(self) -> None:
        for _ in range(_MAX_DRAIN):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity, body = frames[0], [frame.buffer for frame in frames[1:]]
            try:
                request = decode_request(body, self._options.limits)
            except RequestError as exc:
                self._send(identity, self._handler.error_reply("-", exc.request_id, exc))
                continue
            if self._stopping.is_set():
                error = RequestError(ErrorCode.SHUTTING_DOWN, "the server is shutting down; retry on its successor")
                self._send(identity, self._handler.error_reply(request.op.value, request.request_id, error))
                continue
            if self._in_flight >= self._options.max_in_flight:
                error = RequestError(
                    ErrorCode.BUSY, f"{self._in_flight} requests in flight, the most this server takes; retry"
                )
                self._send(identity, self._handler.error_reply(request.op.value, request.request_id, error))
                continue
            if request.op in _INLINE_OPS and len(body[0]) <= _MAX_INLINE_HEADER_BYTES:
                self._send(identity, self._handler.handle(request))  # handle() answers every failure itself
                continue
            pool = self._bulk if request.op in _BULK_OPS else self._control
            self._in_flight += 1
            pool.submit(self._work, identity, request, frames)

    def _forward_replies(self) -> None:
        for _ in range(_MAX_DRAIN):
            try:
                frames = self._pull.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._in_flight -= 1
            self._router.send_multipart(frames, copy=False)

    def _send(self, identity: zmq.Frame, reply: ReplyFrames) -> None:
        parts: list[zmq.Frame | bytes | memoryview] = [identity, reply.header]
        if reply.payload is not None:
            parts.append(reply.payload)
        self._router.send_multipart(parts, copy=False)

    # -- workers -----------------------------------------------------------------------------------------------

    def _work(self, identity: zmq.Frame, request: Request, frames: list[zmq.Frame]) -> None:
        """Run one request on a worker and push its reply to the I/O thread (exactly one reply, always)."""
        try:
            reply = self._handler.handle(request)
        except BaseException:  # handle() answers every failure itself; this is the last line of defence
            logger.exception("worker failed on %s", request.op.value)
            error = RequestError(ErrorCode.INTERNAL, "internal server error")
            reply = self._handler.error_reply(request.op.value, request.request_id, error)
        del frames  # the request's frames (payload) may go now
        parts: list[zmq.Frame | bytes | memoryview] = [identity, reply.header]
        if reply.payload is not None:
            parts.append(reply.payload)
        self._push_socket().send_multipart(parts, copy=False)

    def _push_socket(self) -> zmq.Socket[bytes]:
        push: zmq.Socket[bytes] | None = getattr(self._local, "push", None)
        if push is None:
            push = self._context.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, -1)  # a queued reply is delivered before the socket closes
            push.connect(self._replies_endpoint)
            self._local.push = push
            with self._push_sockets_lock:
                self._push_sockets.append(push)
        return push

    # -- janitor -----------------------------------------------------------------------------------------------

    def _janitor_loop(self) -> None:
        """Give back what dead clients and forgotten plans hold."""
        while not self._janitor_stop.wait(self._options.janitor_interval_s):
            try:
                self._handler.janitor_pass(self._options.plan_ttl_s)
            except Exception:  # the janitor's loop boundary: log, count, keep going
                logger.exception("janitor pass failed")

    # -- shutdown ----------------------------------------------------------------------------------------------

    def _shutdown_workers(self) -> None:
        self._stopping.set()
        self._janitor_stop.set()
        if self._janitor.is_alive():
            self._janitor.join()
        self._control.shutdown(wait=True)
        self._bulk.shutdown(wait=True)
        self._forward_replies()

    def close(self) -> None:
        """Close the sockets (after ``serve_forever`` returned, or instead of it)."""
        self._control.shutdown(wait=True)
        self._bulk.shutdown(wait=True)
        with self._push_sockets_lock:
            for push in self._push_sockets:
                push.close(linger=0)
            self._push_sockets.clear()
        self._pull.close(linger=0)
        self._router.close(linger=0)
        self._context.term()
