"""A reference consumer of kvstore's KV events: what a router does with them, in a few lines of Python.

``ResidencyMirror`` rebuilds a publisher's residency (``(medium, block hash)`` pairs) and what each stored block
holds from its batches; ``Subscriber`` reads the PUB stream into one and fills every gap in the sequence by replay;
``join_late`` rebuilds a mirror from a snapshot and the batches after it (the protocol in
``kvstore.server.kv_events.publisher``), applying each batch as it arrives. Events are decoded by a function the
caller picks: ``decode_events`` (msgspec structs of vLLM's shape whose token ids are read as one array per event,
the fast way for Python), or vLLM's own structs where vLLM is installed. Used by the tests and the benchmark, and a
starting point for a router's own consumer.

Not thread-safe: one thread per subscriber.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec
import numpy as np
import zmq

from kvstore.collector import collector_paused
from kvstore.server.kv_events.publisher import END_SEQ, KEYS_SNAPSHOT_REQUEST, SNAPSHOT_REQUEST

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEventBatch",
    "ResidencyMirror",
    "StoredBlock",
    "Subscriber",
    "answers",
    "decode_events",
    "free_port",
    "join_late",
    "request",
    "token_array",
    "token_arrays",
]

BlockHash = bytes | int
"""vLLM's ``ExternalBlockHash``: kvstore sends 16-byte keys."""


class BlockStored(msgspec.Struct, tag=True, gc=False):
    """vLLM's ``BlockStored`` as it travels, its token ids left as msgpack (``token_array`` reads them): a
    Python consumer that builds an int object per token spends most of a snapshot's time on it."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: msgspec.Raw
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, gc=False):
    """vLLM's ``BlockRemoved``."""

    block_hashes: list[BlockHash]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, gc=False):
    """vLLM's ``AllBlocksCleared``."""


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    """vLLM's ``KVEventBatch``: ``[ts, events]`` (``data_parallel_rank`` when the sender sets it)."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


Decode = Callable[[bytes], Sequence[object]]
"""A batch payload's events, each with vLLM's class name and attributes (these structs, or vLLM's own)."""

_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
_UINT32_ITEM = np.dtype([("marker", "u1"), ("value", ">u4")])  # msgpack "uint 32", as kvstore encodes token ids
_ARRAY_HEADERS = {0xDC: 3, 0xDD: 5}  # array 16 / array 32: header bytes


def decode_events(payload: bytes) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    """A ``KVEventBatch`` payload's events (``ts`` and the rank dropped).

    Raises:
        msgspec.DecodeError: the payload is not a ``KVEventBatch``.
    """
    return _DECODER.decode(payload).events


def token_arrays(token_ids: Sequence[msgspec.Raw | Sequence[int]]) -> list[np.ndarray]:
    """Each event's token ids as a uint32 array. Raw msgpack of one shape (how kvstore sends a batch's chunks:
    ``uint 32`` items, as many in each) is read in one numpy pass for all of them; anything else one at a time
    (``token_array``)."""
    first = token_ids[0] if token_ids else None
    if isinstance(first, msgspec.Raw) and all(isinstance(raw, msgspec.Raw) for raw in token_ids):
        joined = b"".join(token_ids)  # type: ignore[arg-type]  # Raw is a bytes-like buffer
        row_bytes = len(joined) // len(token_ids)
        header_bytes, count = _array_header(memoryview(first))
        one_shape = len(joined) == row_bytes * len(token_ids)
        if header_bytes and one_shape and row_bytes == header_bytes + _UINT32_ITEM.itemsize * count:
            table = np.frombuffer(joined, np.uint8).reshape(len(token_ids), row_bytes)
            items = table[:, header_bytes:].view(_UINT32_ITEM)
            same_header = bool((table[:, :header_bytes] == table[0, :header_bytes]).all())
            if same_header and bool((items["marker"] == 0xCE).all()):
                return list(items["value"].astype(np.uint32))
    return [token_array(value) for value in token_ids]


def token_array(token_ids: msgspec.Raw | Sequence[int]) -> np.ndarray:
    """One event's token ids as a uint32 array (raw msgpack through msgspec; a sequence of ints as it is)."""
    if isinstance(token_ids, msgspec.Raw):
        return np.array(msgspec.msgpack.decode(token_ids, type=list[int]), dtype=np.uint32)
    return np.asarray(token_ids, dtype=np.uint32)


def _array_header(view: memoryview) -> tuple[int, int]:
    """A msgpack array's header bytes and length (``(0, 0)``: not an array)."""
    head = view[0] if len(view) else 0
    if 0x90 <= head <= 0x9F:
        return 1, head & 0x0F
    header_bytes = _ARRAY_HEADERS.get(head, 0)
    return (header_bytes, int.from_bytes(view[1:header_bytes], "big")) if header_bytes else (0, 0)


def free_port() -> int:
    """A TCP port free on loopback now (for a socket the caller binds next)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class StoredBlock(NamedTuple):
    """What the last ``BlockStored`` of a block said of it (a tuple: a snapshot makes a hundred thousand)."""

    parent_block_hash: BlockHash | None
    token_ids: np.ndarray
    block_size: int


@dataclass
class ResidencyMirror:
    """What a publisher holds, rebuilt from its events: ``(medium, block hash)`` pairs, and each stored block's
    parent, tokens and block size (an event of several blocks split into one per block)."""

    decode: Decode = decode_events
    resident: set[tuple[str, BlockHash]] = field(default_factory=set)
    stored: dict[BlockHash, StoredBlock] = field(default_factory=dict)
    last_seq: int = -1
    cleared: int = 0

    def apply(self, seq: int, payload: bytes) -> None:
        """Apply one batch (the collector paused: a snapshot decodes into a hundred thousand objects at a time)."""
        with collector_paused():
            self._apply(payload)
        self.last_seq = max(self.last_seq, seq)

    def _apply(self, payload: bytes) -> None:
        events = self.decode(payload)
        stored = [event for event in events if type(event).__name__ == "BlockStored"]
        tokens = iter(token_arrays([getattr(event, "token_ids", ()) for event in stored]))
        resident, by_hash = self.resident, self.stored
        for event in events:
            kind = type(event).__name__
            if kind == "BlockStored":
                block: Any = event  # these structs or vLLM's: the same fields
                hashes = block.block_hashes
                if len(hashes) == 1:  # kvstore's: a chunk a block (inline: a snapshot has a hundred thousand)
                    resident.add((str(block.medium), hashes[0]))
                    by_hash[hashes[0]] = StoredBlock(block.parent_block_hash, next(tokens), block.block_size)
                else:
                    self._blocks_stored(block, next(tokens))
            elif kind == "BlockRemoved":
                medium = str(getattr(event, "medium", None))
                for block_hash in getattr(event, "block_hashes", ()):
                    self.resident.discard((medium, block_hash))
            elif kind == "AllBlocksCleared":
                self.resident.clear()
                self.cleared += 1
            else:
                raise ValueError(f"not a kv event kvstore publishes: {event!r:.200}")

    def _blocks_stored(self, event: Any, tokens: np.ndarray) -> None:
        """``event``: a ``BlockStored`` of several blocks, of these structs or of vLLM's (the same fields)."""
        medium, hashes, block_size = str(event.medium), event.block_hashes, event.block_size
        for index, block_hash in enumerate(hashes):
            self.resident.add((medium, block_hash))
            parent = event.parent_block_hash if index == 0 else hashes[index - 1]
            self.stored[block_hash] = StoredBlock(parent, tokens[index * block_size : (index + 1) * block_size],
                                                  block_size)  # fmt: skip


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


def answers(replay_endpoint: str, message: bytes, timeout_s: float = 60.0) -> Iterator[tuple[int, bytes]]:
    """One replay or snapshot request: the ``(seq, payload)`` batches of its answer as they arrive (a consumer
    decodes one while the publisher encodes the next), until the end marker."""
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(replay_endpoint)
    try:
        dealer.send_multipart((b"", message))
        deadline = time.monotonic() + timeout_s
        while True:
            if not dealer.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
                raise TimeoutError(f"no end of the answer from {replay_endpoint} within {timeout_s:g} s")
            _, _, seq_bytes, payload = dealer.recv_multipart()
            if seq_bytes == END_SEQ:
                return
            yield int.from_bytes(seq_bytes, "big"), payload
    finally:
        dealer.close(linger=0)
        context.term()


def request(replay_endpoint: str, message: bytes, timeout_s: float = 60.0) -> list[tuple[int, bytes]]:
    """One replay or snapshot request's whole answer (``answers``, collected)."""
    return list(answers(replay_endpoint, message, timeout_s))


def join_late(replay_endpoint: str, mirror: ResidencyMirror, *, with_tokens: bool = True) -> float:
    """Rebuild ``mirror`` from a snapshot and the batches published after it; returns the seconds it took.
    ``with_tokens=False`` asks for the residency alone (``KEYS_SNAPSHOT_REQUEST``: no token ids)."""
    started = time.perf_counter()
    seq: int | None = None
    with collector_paused():  # once for the whole snapshot: re-enabled after each batch, it walked the mirror again
        for batch_seq, payload in answers(replay_endpoint, SNAPSHOT_REQUEST if with_tokens else KEYS_SNAPSHOT_REQUEST):
            if seq is not None and batch_seq != seq:
                raise ValueError(f"a snapshot batch carries seq {batch_seq}, its first {seq}: not one snapshot")
            seq = batch_seq
            mirror.apply(seq, payload)
        first_after = -1 if seq is None else seq
        for replay_seq, payload in answers(replay_endpoint, (first_after + 1).to_bytes(8, "big")):
            mirror.apply(replay_seq, payload)
    return time.perf_counter() - started
