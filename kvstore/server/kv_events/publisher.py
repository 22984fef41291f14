"""Publishes the store's residency as vLLM KV events over ZeroMQ, with replay and a snapshot for late joiners.

The wire is vLLM's (``ZmqEventPublisher``), so a router that subscribes to vLLM engines subscribes to kvstore the
same way: a PUB socket sends ``(topic, seq, payload)`` -- ``seq`` an 8-byte big-endian batch number from 0, the
payload a ``KVEventBatch`` (``encoding``). The replay socket (ROUTER, optional) answers a request frame of 8
big-endian bytes ``n`` with every kept batch from ``n`` on, each as ``(topic, seq, payload)``, then the end marker
``(b"", seq -1, b"")``. kvstore adds one request: ``b"snapshot"`` answers the store's whole residency as
``BlockStored`` batches, every one carrying the same ``seq`` S (the last batch published before the snapshot was
read), then the end marker. A late joiner subscribes first, asks for a snapshot, applies it, then applies the
batches after S (from what it buffered, or a replay from S + 1): it then holds exactly what the store holds
(``docs/routing.md``; each event is a set operation, so the batches after S that the snapshot already reflects
change nothing).

Batch 0 is ``AllBlocksCleared`` (a consumer drops what it held of an earlier run of this server); once the store
opens (at start, or at the first client's layout) its residency follows as ``BlockStored`` batches, then every
change the tiers report (``tiers.residency``), gathered for ``interval_s`` from the first and sent in batches of at
most ``max_events``; inside a batch the events are grouped by tier (``encoding.encode_changes``), which leaves a
consumer with exactly the residency the changes in their order leave.

Threads: the tiers call ``stored`` / ``removed`` from any thread (an append to a queue, and a byte on a socket
pair when the publisher's thread sleeps); one thread owns both sockets, encodes and sends. It sleeps while nothing
is queued and nobody asks (an idle server spends no CPU on events), and once a change comes it gathers changes for
``interval_s`` before it sends them, answering requests meanwhile.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import zmq

from kvstore.errors import ConfigError
from kvstore.keys import PrefixKey
from kvstore.server.kv_events.encoding import (
    MEDIUMS,
    Change,
    EncodedEvents,
    all_blocks_cleared,
    batch,
    blocks_resident,
    blocks_stored_batch,
    encode_changes,
)
from kvstore.server.kv_events.options import KVEventOptions, KVEventStats
from kvstore.store import TieredStore
from kvstore.tiers.base import ChunkRecord, TierName
from kvstore.tiers.residency import SILENT

__all__ = ["END_SEQ", "KEYS_SNAPSHOT_REQUEST", "SNAPSHOT_REQUEST", "KVEventPublisher"]

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The ``seq`` frame that ends a replay or snapshot answer (vLLM's ``ZmqEventPublisher.END_SEQ``)."""

SNAPSHOT_REQUEST = b"snapshot"
"""A replay request for the store's whole residency instead of kept batches."""

KEYS_SNAPSHOT_REQUEST = b"snapshot-keys"
"""A snapshot whose ``BlockStored`` events carry the block hash and medium only (``token_ids`` empty, no parent):
the residency alone, read from the tiers' memory, for a router that keys blocks by hash or learned their tokens
before (a tenth of the bytes to send and decode, and no disk read)."""


class KVEventPublisher:
    """The server's KV event publisher: a ``ResidencyListener`` of the store, once it opens.

    Args:
        options: sockets and batching.
        store_of: the store once it is open, else ``None`` (asked until it is).
        block_size: the store's chunk size (every ``BlockStored``'s ``block_size``).
    """

    def __init__(self, options: KVEventOptions, store_of: Callable[[], TieredStore | None], block_size: int) -> None:
        self._options = options
        self._store_of = store_of
        self._block_size = block_size
        self._changes: collections.deque[Change] = collections.deque()
        self._kept: collections.deque[tuple[int, bytes]] = collections.deque()
        self._kept_bytes = 0
        self._next_seq = 0
        self._events = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}  # written by its thread only
        self._requests = {"replay": 0, "snapshot": 0, "invalid": 0}
        self._cpu_s = 0.0  # the thread's CPU time after its last pass, written by it only
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        # Waking the thread: it sleeps in a poll until a change or a request comes (an idle server spends nothing on
        # events); a tier that queues a change while it sleeps sends a byte on this pair.
        self._wake_receiver, self._wake_sender = socket.socketpair()
        self._wake_receiver.setblocking(False)
        self._wake_sender.setblocking(False)
        self._asleep = False  # set by the thread just before it sleeps, cleared by whoever wakes it
        self._thread = threading.Thread(target=self._run, name="kvstore-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            self._close_wake()
            raise self._failure

    # -- ResidencyListener (any thread, under a tier's lock: only a note) ------------------------------------------

    def stored(self, tier: TierName, record: ChunkRecord) -> None:
        self._changes.append((tier, record))
        if self._asleep:
            self._wake()

    def removed(self, tier: TierName, keys: Sequence[PrefixKey]) -> None:
        self._changes.append((tier, tuple(keys)))
        if self._asleep:
            self._wake()

    def _wake(self) -> None:
        """The thread sleeps: wake it (the flag is read after the append and set before the thread's last look at
        the queue, so a change is never left asleep; a wake too many costs a pass)."""
        self._asleep = False
        with contextlib.suppress(OSError):  # full: a wake is pending already; closed: the thread is gone
            self._wake_sender.send(b"\0")

    def stats(self) -> KVEventStats:
        """Counts so far (read from any thread: each is one int its thread writes)."""
        return KVEventStats(
            batches=self._next_seq,
            events=dict(self._events),
            queued=len(self._changes),
            requests=dict(self._requests),
            cpu_s=self._cpu_s,
        )

    # -- lifecycle --------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Publish what is queued, then close the sockets."""
        self._stop.set()
        self._wake()
        self._thread.join()
        self._close_wake()

    def _close_wake(self) -> None:
        self._wake_sender.close()
        self._wake_receiver.close()

    # -- the publisher thread ----------------------------------------------------------------------------------------

    def _run(self) -> None:
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        try:
            pub, replay = self._open_sockets(context)
        except (zmq.ZMQError, ValueError) as exc:
            replay_endpoint = self._options.replay_endpoint
            also = f" or --kv-events-replay {replay_endpoint}" if replay_endpoint else ""
            self._failure = ConfigError(f"--kv-events: cannot open {self._options.endpoint}{also}: {exc}")
            self._ready.set()
            return
        self._ready.set()
        watched: TieredStore | None = None
        try:
            self._send(pub, EncodedEvents(pieces=[all_blocks_cleared()], num_cleared=1))
            poller = zmq.Poller()
            poller.register(self._wake_receiver, zmq.POLLIN)
            if replay is not None:
                poller.register(replay, zmq.POLLIN)
            while True:
                stopping = self._stop.is_set()
                if watched is None and (store := self._store_of()) is not None:
                    store.watch_residency(self)  # first: a change while the snapshot is read is queued, not lost
                    watched = store
                    for events in self._snapshot_batches(store):
                        self._send(pub, events)
                if not stopping:
                    self._wait_for_a_batch(poller, replay, watched)
                waiting = len(self._changes)  # one batch a pass: what arrives meanwhile waits for the next
                while waiting:
                    count = min(waiting, self._options.max_events)
                    self._send(pub, self._take_changes(count))
                    waiting -= count
                self._cpu_s = time.thread_time()
                if stopping and not self._changes:
                    break
        except Exception:  # the thread's boundary: events stop, the store goes on
            logger.exception("kv events: the publisher failed; no more events are published")
            if watched is not None:
                watched.watch_residency(SILENT)  # nobody would take the queue's changes: stop hearing them
            self._changes.clear()
        finally:
            pub.close(linger=1000)
            if replay is not None:
                replay.close(linger=0)

    def _wait_for_a_batch(
        self, poller: zmq.Poller, replay: zmq.Socket[bytes] | None, watched: TieredStore | None
    ) -> None:
        """Answer requests until the queued changes have waited ``interval_s`` (so that they leave as one batch), or a
        close. With nothing queued, sleep until a change comes; before the store opens, look for it every interval.
        """
        interval_s = self._options.interval_s
        deadline = time.monotonic() + interval_s if self._changes else None
        while not self._stop.is_set():
            if deadline is None:
                self._asleep = True
                if self._changes:  # queued before the flag was seen: no wake will come for it
                    self._asleep = False
                    deadline = time.monotonic() + interval_s
                    continue
                timeout_ms: int | None = max(1, int(1000 * interval_s)) if watched is None else None
            else:
                timeout_ms = math.ceil(1000 * (deadline - time.monotonic()))  # rounded up: no spin in the last ms
                if timeout_ms <= 0:
                    return
            ready = dict(poller.poll(timeout_ms))
            self._asleep = False
            if self._wake_receiver.fileno() in ready:  # a poller names a socket that is not ZeroMQ's by its fd
                self._drain_wakes()
            if replay is not None and replay in ready:
                self._answer(replay, watched)
            if deadline is None:
                if self._changes:
                    deadline = time.monotonic() + interval_s
                elif watched is None and not ready:
                    return  # an interval without news: time to ask for the store again
            elif time.monotonic() >= deadline:
                return

    def _drain_wakes(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while self._wake_receiver.recv(4096):
                pass

    def _open_sockets(
        self, context: zmq.Context[zmq.Socket[bytes]]
    ) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes] | None]:
        options = self._options
        pub = context.socket(zmq.PUB)
        pub.set_hwm(100_000)
        try:
            if options.binds:
                pub.bind(options.endpoint)
            else:
                pub.connect(options.endpoint)
            replay = None
            if options.replay_endpoint is not None:
                replay = context.socket(zmq.ROUTER)
                replay.bind(options.replay_endpoint)
        except BaseException:
            pub.close(linger=0)
            raise
        logger.info("kv events: publishing on %s%s", options.endpoint,
                    f", replay on {options.replay_endpoint}" if options.replay_endpoint else "")  # fmt: skip
        return pub, replay

    def _take_changes(self, count: int) -> EncodedEvents:
        """The first ``count`` queued changes as events (``encode_changes``: in as few runs as keep them exact)."""
        changes = [self._changes.popleft() for _ in range(count)]
        return encode_changes(changes, self._block_size)

    def _snapshot_batches(self, store: TieredStore) -> Iterator[EncodedEvents]:
        """The store's residency as ``BlockStored`` batches of up to ``max_events``, encoded from the tiers' record
        arrays (``blocks_stored_batch``)."""
        size = self._options.max_events
        pieces: list[bytes] = []
        num_events = 0
        for tier, records in store.resident_records():
            first = 0
            while first < len(records):
                stop = min(len(records), first + size - num_events)
                pieces.append(blocks_stored_batch(records, first, stop, self._block_size, MEDIUMS[tier]))
                num_events += stop - first
                first = stop
                if num_events == size:
                    yield EncodedEvents(pieces=pieces, num_stored=num_events)
                    pieces, num_events = [], 0
        if num_events:
            yield EncodedEvents(pieces=pieces, num_stored=num_events)

    def _keys_batches(self, store: TieredStore) -> Iterator[EncodedEvents]:
        """The store's residency as keys-only ``BlockStored`` batches, from the tiers' memory."""
        size = self._options.max_events
        for tier, keys in store.resident_keys():
            for first in range(0, len(keys), size):
                events = blocks_resident(keys[first : first + size], self._block_size, MEDIUMS[tier])
                yield EncodedEvents(pieces=events, num_stored=len(events))

    def _send(self, pub: zmq.Socket[bytes], events: EncodedEvents) -> None:
        seq = self._next_seq
        self._events["BlockStored"] += events.num_stored
        self._events["BlockRemoved"] += events.num_removed
        self._events["AllBlocksCleared"] += events.num_cleared
        payload = batch(time.time(), events.pieces, events.num_events)
        pub.send_multipart((self._options.topic.encode(), seq.to_bytes(8, "big"), payload))
        self._kept.append((seq, payload))
        self._kept_bytes += len(payload)
        while len(self._kept) > self._options.buffer_steps or self._kept_bytes > self._options.buffer_bytes:
            self._kept_bytes -= len(self._kept.popleft()[1])
        self._next_seq = seq + 1

    def _answer(self, replay: zmq.Socket[bytes], store: TieredStore | None) -> None:
        """One replay or snapshot request."""
        frames = replay.recv_multipart()
        topic = self._options.topic.encode()
        if len(frames) != 3:
            logger.warning("kv events: a replay request of %d frames, not 3 (identity, empty, request); ignored",
                           len(frames))  # fmt: skip
            return
        client, _, request = frames
        if request in (SNAPSHOT_REQUEST, KEYS_SNAPSHOT_REQUEST):
            self._requests["snapshot"] += 1
            last = (self._next_seq - 1).to_bytes(8, "big")  # batch 0 is always sent first: never negative
            if store is not None:
                batches = self._snapshot_batches(store) if request == SNAPSHOT_REQUEST else self._keys_batches(store)
                for events in batches:
                    payload = batch(time.time(), events.pieces, events.num_events)
                    replay.send_multipart((client, b"", topic, last, payload))
        elif len(request) == 8:
            self._requests["replay"] += 1
            first = int.from_bytes(request, "big")
            for seq, payload in self._kept:
                if seq >= first:
                    replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
        else:
            self._requests["invalid"] += 1
            logger.warning("kv events: a replay request of %d bytes is neither a sequence number nor %r; ignored",
                           len(request), SNAPSHOT_REQUEST)  # fmt: skip
        replay.send_multipart((client, b"", b"", END_SEQ, b""))
