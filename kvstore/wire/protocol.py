"""The wire protocol between ``kvstore.Client`` and ``kvstore serve``: ZeroMQ frames carrying msgpack headers.

Transport: the server binds a ZeroMQ ROUTER socket (``tcp://host:port``); a client connects a DEALER socket, so it
may have requests in flight and match replies by id (a late reply to a timed-out request is dropped, never taken
for the answer to the next one). Each message is one or two frames::

    request: | header (msgpack map) | [payload: raw KV bytes, inline bulk only] |
    reply:   | header (msgpack map) | [payload: raw KV bytes, inline retrieve only] |

    request header: {"v": 3, "id": <int>, "op": <str>, "client": <str | nil>, "args": <map>}
    ok reply:       {"v": 3, "id": <int>, "ok": true,  "result": <map>}
    error reply:    {"v": 3, "id": <int | nil>, "ok": false, "error": {"code": <str>, "message": <str>}}

Handshake: a client's first request is ``hello`` (its ``KVLayout`` as canonical JSON, or nil for an admin
client, its pid and host id); the reply gives the ``client`` token to put in every later header and the server's
chunk size, tiers, features and limits. A header whose ``v`` is not ``PROTOCOL_VERSION`` gets
``unsupported_version``; a token the server does not know (it restarted) gets ``not_registered``, and the client
says hello again. Operations and their arguments are in ``messages``; values (plans, stats) in ``values``.
Version 2 sent plan segments as packed rows in one ``bin`` (version 1: an array per segment); version 3 names the
server's data dir ``data_dir`` in ``info`` (version 2: ``disk_path``), one spelling with every command's. Fields
added within a version are optional and sent only when set (retrieve's ``memory_only``, store's ``start``): an
older server still takes every request that does not use them, and refuses one that does as an unknown field.
A lookup's ``partial`` (the plan may hold slices of stored chunks) is sent only to a server whose hello says
``partial_segments``. The other way round a client reads a newer server's hello whole and ignores what it adds
(fields, features, limits: capabilities it never asks for), so older clients keep working through a rolling upgrade.

Bulk KV (``messages.BulkRef``) travels by reference through a shared-memory segment the client attached (same
host: no copy beyond the tier's own), inline as the second frame (remote clients), or as a CUDA IPC handle.

Validation is strict (``fields``): exact msgpack types, ranges, sizes, no unknown keys (but in the hello's reply).
Anything wrong becomes an error reply with an ``ErrorCode`` and a one-line message; decoding never raises anything
but ``RequestError``.

Pure functions; thread-safe.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgpack

from kvstore.wire.error_codes import ErrorCode, RequestError
from kvstore.wire.fields import Fields, describe_type

__all__ = [
    "PROTOCOL_VERSION",
    "Limits",
    "Op",
    "Reply",
    "Request",
    "decode_reply",
    "decode_request",
    "encode_error",
    "encode_ok",
    "encode_request",
    "unpack_map",
]

PROTOCOL_VERSION = 3
_MIB = 1024 * 1024
_MAX_REQUEST_ID = 2**63 - 1
_MAX_CLIENT_ID_CHARS = 64


class Op(enum.StrEnum):
    """Operations a server answers (arguments and results: ``messages``)."""

    HELLO = "hello"
    GOODBYE = "goodbye"
    STORE = "store"
    LOOKUP = "lookup"
    RETRIEVE = "retrieve"
    RELEASE = "release"
    END_SESSION = "end_session"
    FLUSH = "flush"
    STATS = "stats"
    INFO = "info"
    EVICT = "evict"
    CHUNK = "chunk"
    HEALTH = "health"
    ATTACH = "attach"
    DETACH = "detach"
    DOCUMENTS = "documents"
    LEND = "lend"
    RETURN = "return"


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """Sizes a server accepts; sent to clients in the hello reply.

    Args:
        max_header_bytes: largest header frame (a 4M-token prompt's ids are 16 MiB).
        max_payload_bytes: largest inline KV frame (remote clients; local ones use shared memory).
        max_tokens: most token ids in one request.
        max_keys: most chunk keys in one evict request.
    """

    max_header_bytes: int = 20 * _MIB
    max_payload_bytes: int = 2048 * _MIB
    max_tokens: int = 4 * _MIB
    max_keys: int = 65536


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    """A decoded request whose header is valid; ``args`` still has to be read by the op's parser."""

    request_id: int
    op: Op
    client_id: str | None
    args: Fields
    payload: memoryview | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Reply:
    """A decoded reply: ``result`` when ``ok``, else ``error_code`` and ``error_message``."""

    request_id: int | None
    ok: bool
    result: Fields | None
    error_code: str
    error_message: str
    payload: memoryview | None


def unpack_map(frame: bytes | memoryview, where: str) -> dict[object, object]:
    """Decode one msgpack frame that must hold a map.

    Raises:
        RequestError: ``malformed`` when the bytes are not one complete msgpack map.
    """
    try:
        value = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, TypeError, msgpack.UnpackException, msgpack.ExtraData, RecursionError) as exc:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise RequestError(ErrorCode.MALFORMED, f"{where} is not valid msgpack ({detail[:120]})") from None
    if not isinstance(value, dict):
        raise RequestError(ErrorCode.MALFORMED, f"{where} must be a msgpack map, got {describe_type(value)}")
    return value


def decode_request(frames: Sequence[memoryview], limits: Limits) -> Request:
    """Check a request's frames and header.

    Raises:
        RequestError: what is wrong, with ``request_id`` set whenever the header's id could be read.
    """
    if not frames or len(frames) > 2:
        raise RequestError(
            ErrorCode.MALFORMED, f"a request is 1 or 2 frames (header, optional payload), got {len(frames)}"
        )
    header_frame = frames[0]
    if len(header_frame) > limits.max_header_bytes:
        raise RequestError(
            ErrorCode.TOO_LARGE,
            f"header frame is {len(header_frame):,} bytes, at most {limits.max_header_bytes:,} allowed",
        )
    header = unpack_map(header_frame, "header")
    request_id = header.get("id")
    known_id = request_id if type(request_id) is int and 0 <= request_id <= _MAX_REQUEST_ID else None
    try:
        return _check_header(header, frames, limits)
    except RequestError as exc:
        exc.request_id = known_id
        raise


def _check_header(header: Mapping[object, object], frames: Sequence[memoryview], limits: Limits) -> Request:
    version = header.get("v")
    if version != PROTOCOL_VERSION or type(version) is not int:
        raise RequestError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"protocol version {version!r} is not supported; this server speaks version {PROTOCOL_VERSION}: "
            "use a kvstore client of the same release",
        )
    fields = Fields(header, "header")
    request_id = fields.required_int("id", 0, _MAX_REQUEST_ID)
    op_name = fields.required_str("op", 32)
    try:
        op = Op(op_name)
    except ValueError:
        raise RequestError(
            ErrorCode.UNKNOWN_OP, f"unknown op {op_name!r}; ops: {', '.join(o.value for o in Op)}"
        ) from None
    client_id = fields.str_("client", _MAX_CLIENT_ID_CHARS, optional=True)
    args = fields.map_("args", f"{op.value} args")
    fields.required_int("v", PROTOCOL_VERSION, PROTOCOL_VERSION)
    fields.finish()
    payload = frames[1] if len(frames) == 2 else None
    if payload is not None and len(payload) > limits.max_payload_bytes:
        raise RequestError(
            ErrorCode.TOO_LARGE,
            f"payload frame is {len(payload):,} bytes, at most {limits.max_payload_bytes:,} allowed inline; "
            "use shared memory (same host) or store fewer tokens per request",
        )
    return Request(request_id=request_id, op=op, client_id=client_id, args=args, payload=payload)


def _pack(value: Mapping[str, object]) -> bytes:
    packed: bytes = msgpack.packb(value, use_bin_type=True)
    return packed


def encode_request(request_id: int, op: Op, client_id: str | None, args: Mapping[str, object]) -> bytes:
    """The header frame of a request."""
    return _pack({"v": PROTOCOL_VERSION, "id": request_id, "op": op.value, "client": client_id, "args": dict(args)})


def encode_ok(request_id: int, result: Mapping[str, object]) -> bytes:
    """The header frame of a successful reply."""
    return _pack({"v": PROTOCOL_VERSION, "id": request_id, "ok": True, "result": dict(result)})


def encode_error(request_id: int | None, code: ErrorCode, message: str) -> bytes:
    """The header frame of an error reply; the message is cut to one line."""
    line = message.replace("\n", " ")[:1000]
    error = {"code": code.value, "message": line}
    return _pack({"v": PROTOCOL_VERSION, "id": request_id, "ok": False, "error": error})


def decode_reply(frames: Sequence[memoryview]) -> Reply:
    """Check a reply's frames and header (client side).

    Raises:
        RequestError: the reply is malformed (a server bug or a server of another version).
    """
    if not frames or len(frames) > 2:
        raise RequestError(ErrorCode.MALFORMED, f"a reply is 1 or 2 frames, got {len(frames)}")
    header = Fields(unpack_map(frames[0], "reply header"), "reply header")
    header.required_int("v", PROTOCOL_VERSION, PROTOCOL_VERSION)
    request_id = header.int_("id", 0, _MAX_REQUEST_ID, optional=True)
    ok = header.required_bool("ok")
    payload = frames[1] if len(frames) == 2 else None
    if ok:
        result = header.map_("result", "reply result")
        header.finish()
        return Reply(request_id=request_id, ok=True, result=result, error_code="", error_message="", payload=payload)
    error = header.map_("error", "reply error")
    header.finish()
    code = error.required_str("code", 64)
    message = error.str_("message", 10_000, allow_empty=True) or ""
    error.finish()
    return Reply(request_id=request_id, ok=False, result=None, error_code=code, error_message=message, payload=None)
