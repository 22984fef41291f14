"""10,000 bad messages on a live server: each gets an error reply, and the server stays up and correct."""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

from kvstore import Client
from kvstore.wire.protocol import PROTOCOL_VERSION, decode_reply
from tests.factories import make_kv, make_tokens
from tests.server.conftest import SERVER_LAYOUT, running_server

pytestmark = pytest.mark.slow

NUM_MESSAGES = 10_000
WINDOW = 64  # requests in flight at once
Frames = list[bytes]
_JUNK: list[object] = [None, True, 1.5, -3, "text", b"bytes", [1, 2], {"a": 1}]
_HEADER_TYPES: dict[str, tuple[type, ...]] = {"id": (int,), "op": (str,), "client": (str, type(None)), "args": ()}
_ARG_TYPES: dict[str, tuple[type, ...]] = {
    "tokens": (bytes,),
    "session_id": (str, type(None)),
    "blend": (bool, type(None)),
    "bulk": (),
    "durable": (bool,),
    "plan_id": (int,),
    "keys": (),
    "key": (bytes,),
    "name": (str,),
    "nbytes": (int,),
    "fd": (int,),
    "segment_id": (int,),
    "top": (int,),
}


_request_ids = itertools.count(2)


def _header(op: str, args: object, client: object = None, **overrides: object) -> bytes:
    header: dict[str, object] = {
        "v": PROTOCOL_VERSION, "id": next(_request_ids), "op": op, "client": client, "args": args
    }  # fmt: skip
    header.update(overrides)
    return msgpack.packb(header, use_bin_type=True)


class BadMessages:
    """Generators of invalid requests, each named by its category."""

    def __init__(self, rng: random.Random, client_id: str) -> None:
        self.rng = rng
        self.client_id = client_id
        tokens = bytes(4 * 8)
        self.valid: list[tuple[str, dict[str, object]]] = [
            ("lookup", {"tokens": tokens, "session_id": "s", "blend": None}),
            ("store", {"tokens": tokens, "bulk": {"kind": "inline"}, "durable": False}),
            ("retrieve", {"plan_id": 1, "bulk": {"kind": "inline"}}),
            ("release", {"plan_id": 1}),
            ("end_session", {"session_id": "s"}),
            ("evict", {"keys": [bytes(16)]}),
            ("chunk", {"key": bytes(16)}),
            ("attach", {"name": "kvstore-1-" + "0" * 16, "nbytes": 64, "fd": 3}),
            ("detach", {"segment_id": 1}),
            ("documents", {"top": 5}),
        ]

    def categories(self) -> dict[str, Callable[[], Frames]]:
        return {
            "garbage": self.garbage,
            "truncated": self.truncated,
            "wrong_type": self.wrong_type,
            "unknown_op": self.unknown_op,
            "wrong_version": self.wrong_version,
            "wrong_layout": self.wrong_layout,
            "no_or_bad_client": self.bad_client,
            "bad_reference": self.bad_reference,
            "extra_field": self.extra_field,
            "frames": self.frames,
        }

    def garbage(self) -> Frames:
        return [self.rng.randbytes(self.rng.randint(0, 200))]

    def truncated(self) -> Frames:
        op, args = self.rng.choice(self.valid)
        full = _header(op, args, self.client_id)
        return [full[: self.rng.randint(0, len(full) - 1)]]

    def wrong_type(self) -> Frames:
        """One header or argument field replaced by a value of a type that field never accepts."""
        op, args = self.rng.choice(self.valid)
        if self.rng.random() < 0.3:
            field = self.rng.choice(["id", "op", "client", "args"])
            header = msgpack.unpackb(_header(op, args, self.client_id))
            header[field] = self._junk(_HEADER_TYPES[field])
            return [msgpack.packb(header, use_bin_type=True)]
        field = self.rng.choice(list(args))
        return [_header(op, dict(args) | {field: self._junk(_ARG_TYPES[field])}, self.client_id)]

    def _junk(self, valid: tuple[type, ...]) -> object:
        return self.rng.choice([junk for junk in _JUNK if type(junk) not in valid])

    def unknown_op(self) -> Frames:
        name = self.rng.choice(["", "STORE", "drop_table", "lookup ", "x" * 40, "hello2"])
        return [_header(name, {}, self.client_id)]

    def wrong_version(self) -> Frames:
        wrong = [0, 1, PROTOCOL_VERSION + 1, 99, -1, str(PROTOCOL_VERSION), float(PROTOCOL_VERSION), None]
        return [_header("health", {}, v=self.rng.choice(wrong))]

    def wrong_layout(self) -> Frames:
        layout = json.loads(SERVER_LAYOUT.to_json())
        change = self.rng.choice(["num_layers", "head_dim", "model_id", "dtype", "theta", "garbage", "missing"])
        if change in ("num_layers", "head_dim"):
            layout[change] += self.rng.randint(1, 7)
        elif change == "model_id":
            layout["model_id"] = f"someone-else-{self.rng.randint(0, 99)}"
        elif change == "dtype":
            layout["dtype"] = self.rng.choice(["float32", "float16", "int8"])
        elif change == "theta":
            layout["rope"]["theta"] = self.rng.choice([1.0, float("inf"), -5.0, "big"])
        elif change == "missing":
            del layout["num_kv_heads"]
        text = json.dumps(layout) if change != "garbage" else "{not json"
        return [_header("hello", {"layout": text, "client_name": "fuzz", "pid": 1, "host_id": ""})]

    def bad_client(self) -> Frames:
        op, args = self.rng.choice(self.valid)
        return [_header(op, args, self.rng.choice([None, "0" * 16, "nobody"]))]

    def bad_reference(self) -> Frames:
        """Well-formed requests from a registered client that name things that do not exist or do not fit."""
        choice = self.rng.randrange(7)
        plan_id = self.rng.randint(10**6, 10**9)
        if choice == 0:
            return [_header("retrieve", {"plan_id": plan_id, "bulk": {"kind": "inline"}}, self.client_id)]
        if choice == 1:
            return [_header("release", {"plan_id": plan_id}, self.client_id)]
        if choice == 2:
            bulk = {"kind": "shm", "segment_id": self.rng.randint(1, 1000), "offset": 0, "nbytes": 256 * 8}
            return [_header("store", {"tokens": bytes(32), "bulk": bulk, "durable": False}, self.client_id)]
        if choice == 3:  # inline payload of the wrong size
            args = {"tokens": bytes(32), "bulk": {"kind": "inline"}, "durable": False}
            return [_header("store", args, self.client_id), self.rng.randbytes(self.rng.randint(0, 4000))]
        if choice == 4:  # tokens not a whole number of uint32
            args = {"tokens": bytes(self.rng.choice([1, 2, 3, 5, 7])), "session_id": None, "blend": None}
            return [_header("lookup", args, self.client_id)]
        if choice == 5:  # a segment name that is not this client's, or not a segment name at all
            name = self.rng.choice(["../../etc/passwd", "kvstore-1-" + "f" * 16, "kvstore-x", "/dev/shm/a"])
            return [_header("attach", {"name": name, "nbytes": 64, "fd": self.rng.randint(0, 64)}, self.client_id)]
        return [_header("health", {}, None), b"unexpected payload"]

    def extra_field(self) -> Frames:
        op, args = self.rng.choice(self.valid)
        return [_header(op, dict(args) | {"surprise": 1}, self.client_id)]

    def frames(self) -> Frames:
        return [_header("health", {})] * self.rng.randint(3, 5)

    def stream(self, count: int) -> Iterator[tuple[str, Frames]]:
        categories = self.categories()
        names = sorted(categories)
        for _ in range(count):
            name = self.rng.choice(names)
            yield name, categories[name]()


def _id_of(frames: Frames) -> int:
    try:
        request_id = msgpack.unpackb(frames[0], strict_map_key=False).get("id", -1)
    except Exception:
        return -1
    return request_id if isinstance(request_id, int) else -1


def _hello(socket: zmq.Socket[bytes]) -> str:
    args = {"layout": SERVER_LAYOUT.to_json(), "client_name": "fuzzer", "pid": 1, "host_id": ""}
    socket.send_multipart([_header("hello", args)])
    assert socket.poll(30_000)
    reply = decode_reply([frame.buffer for frame in socket.recv_multipart(copy=False)])
    assert reply.ok and reply.result is not None
    return reply.result.required_str("client_id", 64)


def test_ten_thousand_bad_messages_get_error_replies_and_the_server_stays_correct(tmp_path: Path) -> None:
    with running_server(tmp_path / "data") as server:
        tokens, kv = make_tokens(64, seed=5), make_kv(SERVER_LAYOUT, 64, seed=5)
        with Client(server.url, SERVER_LAYOUT) as client:
            client.store(tokens, kv, durable=True)
        context = zmq.Context()
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(server.url)
        sent: Counter[str] = Counter()
        category_of: dict[int, tuple[str, Frames]] = {}
        codes: Counter[str] = Counter()
        try:
            messages = BadMessages(random.Random(2026), _hello(socket)).stream(NUM_MESSAGES)
            oversized = [("oversized", [b"\x00" * (20 * 2**20 + 1)])] * 3
            pending = 0
            for name, frames in [*oversized, *messages]:
                socket.send_multipart(frames)
                category_of[_id_of(frames)] = (name, frames)
                sent[name] += 1
                pending += 1
                while pending >= WINDOW or (pending and sent.total() == NUM_MESSAGES + len(oversized)):
                    assert socket.poll(30_000), f"no reply after {sent.total()} messages: the server hangs"
                    reply = decode_reply([frame.buffer for frame in socket.recv_multipart(copy=False)])
                    assert not reply.ok, f"a bad message was accepted: {category_of.get(reply.request_id or 0)}"
                    assert reply.error_message and "\n" not in reply.error_message
                    codes[reply.error_code] += 1
                    pending -= 1
        finally:
            socket.close()
            context.term()
        assert codes.total() == sent.total() == NUM_MESSAGES + 3
        assert {"malformed", "invalid_argument", "unknown_op", "unsupported_version", "layout_mismatch",
                "not_registered", "unknown_plan", "unknown_segment", "too_large"} <= set(codes), codes  # fmt: skip
        assert "internal" not in codes, codes
        assert server.process.poll() is None, "the server died"
        with Client(server.url, SERVER_LAYOUT) as client:
            assert torch.equal(client.retrieve(client.lookup(tokens)).kv, kv), "the server still serves correctly"
            stats = client.stats()
            assert stats.num_open_plans == 0 and stats.num_sessions == 0
            assert all(tier.corrupt_reads == 0 for tier in stats.tiers)
    assert "Traceback" not in server.stderr()
