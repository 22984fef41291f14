"""A reference consumer of kvstore's KV events: what a router does with them, in a few lines of Python.

``ResidencyMirror`` rebuilds a publisher's residency (``(medium, block hash)`` pairs) from its batches;
``Subscriber`` reads the PUB stream into one and fills every gap in the sequence by replay; ``join_late`` rebuilds a
mirror from a snapshot and the batches after it (the protocol in ``kvstore.server.kv_events.publisher``). Events are
decoded by a function the caller picks: plain msgpack (``decode_with_msgpack``), or vLLM's own msgspec structs where
vLLM is installed. Used by the tests and the benchmark, and a starting point for a router's own consumer.

Not thread-safe: one thread per subscriber.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgpack
import zmq

from kvstore.collector import collector_paused
from kvstore.server.kv_events.publisher import END_SEQ, KEYS_SNAPSHOT_REQUEST, SNAPSHOT_REQUEST

__all__ = ["ResidencyMirror", "Subscriber", "decode_with_msgpack", "free_port", "join_late", "request"]

Event = dict[str, object]
Decode = Callable[[bytes], list[Event]]


def decode_with_msgpack(payload: bytes) -> list[Event]:
    """A ``KVEventBatch`` payload's events as maps (``ts`` and the rank dropped)."""
    fields = msgpack.unpackb(payload)
    if not (isinstance(fields, list) and len(fields) in (2, 3) and isinstance(fields[0], float)):
        raise ValueError(f"not a KVEventBatch: {fields!r:.200}")
    return list(fields[1])


def free_port() -> int:
    """A TCP port free on loopback now (for a socket the caller binds next)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class ResidencyMirror:
    """What a publisher holds, rebuilt from its events: ``(medium, block hash)`` pairs and each stored block's
    parent, tokens and block size."""

    decode: Decode = decode_with_msgpack
    resident: set[tuple[str, bytes]] = field(default_factory=set)
    stored: dict[bytes, Event] = field(default_factory=dict)
    last_seq: int = -1
    cleared: int = 0

    def apply(self, seq: int, payload: bytes) -> None:
        """Apply one batch (the collector paused: a snapshot decodes into a hundred thousand objects at a time)."""
        with collector_paused():
            self._apply(payload)
        self.last_seq = max(self.last_seq, seq)

    def _apply(self, payload: bytes) -> None:
        for event in self.decode(payload):
            kind = event["type"]
            if kind == "AllBlocksCleared":
                self.resident.clear()
                self.cleared += 1
                continue
            hashes = event["block_hashes"]
            if not isinstance(hashes, list) or kind not in ("BlockStored", "BlockRemoved"):
                raise ValueError(f"not a kv event kvstore publishes: {event!r:.200}")
            for block_hash in hashes:
                if kind == "BlockStored":
                    self.resident.add((str(event["medium"]), block_hash))
                    self.stored[block_hash] = event
                else:
                    self.resident.discard((str(event["medium"]), block_hash))


class Subscriber:
    """A SUB socket bound on loopback (the publisher connects to it, as to llm-d's), read into a mirror; a gap in the
    sequence (batches sent before the subscription reached the publisher, or dropped) is filled by a replay."""

    def __init__(
        self, mirror: ResidencyMirror, replay_endpoint: str, topic: bytes = b"", high_water_mark: int = 1000
    ) -> None:
        self.mirror = mirror
        self.replay_endpoint = replay_endpoint
        self.num_replayed = 0
        self.port = free_port()
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic)
        self._sub.set_hwm(high_water_mark)  # batches queued before a reader takes them; more are dropped (replayed)
        self._sub.bind(f"tcp://127.0.0.1:{self.port}")
        self.seqs: list[int] = []

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def receive(self, quiet_s: float = 1.0, timeout_s: float = 60.0) -> int:
        """Apply batches until none came for ``quiet_s``, replaying what the subscription missed before and after;
        returns how many came live.

        A bound SUB sends its subscription to a connecting PUB only once it processes commands (libzmq: when it is
        polled), so what was published before is never delivered: a consumer catches up by replay."""
        self._sub.poll(0)
        self._catch_up(None)
        count = 0
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._sub.poll(int(quiet_s * 1000)):
            _, seq_bytes, payload = self._sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            self.seqs.append(seq)
            if seq <= self.mirror.last_seq:
                continue  # replayed already
            self._catch_up(seq)
            self.mirror.apply(seq, payload)
            count += 1
        self._catch_up(None)
        return count

    def _catch_up(self, before: int | None) -> None:
        """Replay what came after the mirror's last batch (and before ``before``, when given)."""
        if before is not None and before == self.mirror.last_seq + 1:
            return
        for seq, payload in request(self.replay_endpoint, (self.mirror.last_seq + 1).to_bytes(8, "big")):
            if before is None or seq < before:
                self.mirror.apply(seq, payload)
                self.num_replayed += 1

    def close(self) -> None:
        self._sub.close(linger=0)
        self._context.term()


def request(replay_endpoint: str, message: bytes, timeout_s: float = 60.0) -> list[tuple[int, bytes]]:
    """One replay or snapshot request: the ``(seq, payload)`` batches answered before the end marker."""
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(replay_endpoint)
    try:
        dealer.send_multipart((b"", message))
        answered: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + timeout_s
        while True:
            if not dealer.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
                raise TimeoutError(f"no end of the answer from {replay_endpoint} within {timeout_s:g} s")
            _, _, seq_bytes, payload = dealer.recv_multipart()
            if seq_bytes == END_SEQ:
                return answered
            answered.append((int.from_bytes(seq_bytes, "big"), payload))
    finally:
        dealer.close(linger=0)
        context.term()


def join_late(replay_endpoint: str, mirror: ResidencyMirror, *, with_tokens: bool = True) -> float:
    """Rebuild ``mirror`` from a snapshot and the batches published after it; returns the seconds it took.
    ``with_tokens=False`` asks for the residency alone (``KEYS_SNAPSHOT_REQUEST``: no token ids)."""
    started = time.perf_counter()
    snapshot = request(replay_endpoint, SNAPSHOT_REQUEST if with_tokens else KEYS_SNAPSHOT_REQUEST)
    seq = snapshot[0][0] if snapshot else -1
    for batch_seq, payload in snapshot:
        if batch_seq != seq:
            raise ValueError(f"a snapshot batch carries seq {batch_seq}, its first {seq}: not one snapshot")
        mirror.apply(seq, payload)
    for replay_seq, payload in request(replay_endpoint, (seq + 1).to_bytes(8, "big")):
        mirror.apply(replay_seq, payload)
    return time.perf_counter() - started
