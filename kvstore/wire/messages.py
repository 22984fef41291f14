"""The arguments of each operation: frozen values, parsed strictly from a request's ``args`` map.

Each ``*Args`` class has ``parse`` (server side: ``Fields`` -> value, raising ``RequestError``) and ``to_wire``
(client side: value -> map). Token ids travel as one ``bin`` of little-endian uint32 (4 bytes a token: a 15k-token
prompt is a 60 KB memcpy, not 15k msgpack ints to decode). Chunk keys are 16-byte ``bin``.

    op           args                                              result (values)
    hello        layout (canonical JSON | nil), client_name, pid,  client id, server version, layout, chunk size,
                 host_id                                           tiers, features, limits, host id
    goodbye      -                                                 - (plans, sessions, segments dropped)
    store        tokens, bulk (BulkRef), durable, start | absent   StoreResult (of the chunks from start)
    lookup       tokens, session_id | nil, blend | nil             plan: plan_id, num_query_tokens, segments (rows)
    retrieve     plan_id, bulk (where the KV goes), start | absent, loaded segments from start, end (+ inline payload
                 memory_only | absent, owner | absent              of tokens [start, end))
    release      plan_id                                           -
    end_session  session_id                                        -
    flush        -                                                 -
    stats        -                                                 StoreStats + server counters
    info         -                                                 settings, layout, clients
    evict        keys | num_bytes + tier                           chunks dropped / bytes freed
    chunk        key                                               tiers holding it
    health       -                                                 status, uptime (no hello needed)
    attach       name, nbytes                                      segment_id
    detach       segment_id                                        -
    documents    top (1..1000)                                     most-hit documents (``documents``)

A ``BulkRef`` says where a request's KV is (store) or should go (retrieve): ``{"kind": "inline"}`` (the payload
frame), ``{"kind": "shm", "segment_id", "offset", "nbytes"}`` (a region of a segment this client attached), or
``{"kind": "cuda_ipc", ...}`` (a CUDA tensor shared by handle, ``cuda_ipc``). A store's bulk holds the KV of
``tokens[start:]`` only; ``start`` (a chunk boundary, 0 when absent) is sent only when it is not 0, so a server
from before the field still takes every other store. A retrieve's ``start`` (any token) likewise: the caller holds
``[0, start)``, and only ``[start, end)`` travels.

Pure values; thread-safe.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.errors import ConfigError, InvalidInputError
from kvstore.keys import KEY_BYTES, PrefixKey, TokenArray
from kvstore.kv_part import KVPart
from kvstore.layout import KVLayout
from kvstore.tiers.base import TierName
from kvstore.wire.cuda_ipc import CudaIpcHandle
from kvstore.wire.error_codes import ErrorCode, RequestError
from kvstore.wire.fields import Fields
from kvstore.wire.protocol import Limits

__all__ = [
    "AttachArgs",
    "BulkKind",
    "BulkRef",
    "ChunkArgs",
    "CudaIpcBulk",
    "DetachArgs",
    "EvictArgs",
    "HelloArgs",
    "InlineBulk",
    "LendArgs",
    "LookupArgs",
    "PlanArgs",
    "RetrieveArgs",
    "SessionArgs",
    "ShmBulk",
    "StoreArgs",
    "layout_from_json",
    "parse_bulk",
    "parse_part",
    "tokens_from_wire",
    "tokens_to_wire",
]

_MAX_NAME_CHARS = 128
_MAX_CLIENT_TOKEN_CHARS = 64  # hello's client tokens are 16 hex digits
_MAX_SESSION_CHARS = 256
_MAX_HOST_ID_CHARS = 256
_MAX_LAYOUT_JSON_CHARS = 64 * 1024
_MAX_SEGMENT_ID = 2**31 - 1
_MAX_PLAN_ID = 2**63 - 1
_MAX_OFFSET = 2**48
_MAX_READERS = 4096  # the ranks of one engine (tensor x pipeline parallel)
_MAX_RETRIEVE_START = 2**40  # a token position; the store checks it against the plan
_SHM_ALIGN_BYTES = 64
_MAX_LAYOUT_DIM = 1 << 16


def layout_from_json(text: str) -> KVLayout:
    """A client's layout from its canonical JSON, every field type- and range-checked first.

    Raises:
        RequestError: ``invalid_argument`` naming the bad field.
    """
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError):
        raise RequestError(ErrorCode.INVALID_ARGUMENT, "hello layout is not JSON; send KVLayout.to_json()") from None
    fields = Fields(raw, "hello layout")
    fields.required_str("model_id", 512)
    for name in ("num_layers", "num_kv_heads", "head_dim"):
        fields.required_int(name, 1, _MAX_LAYOUT_DIM)
    fields.required_str("dtype", 16)
    rope = fields.map_("rope", "hello layout.rope")
    for name in ("theta", "factor", "low_freq_factor", "high_freq_factor"):
        if not math.isfinite(rope.float_(name, -1e30, 1e30)):
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"hello layout.rope.{name} must be finite")
    rope.required_str("scaling", 16)
    rope.required_int("original_max_position_embeddings", 1, 2**31)
    extra = rope.optional_map("extra")  # a yarn scheme's further parameters
    if extra is not None:
        names = extra.names()
        if len(names) > 16 or any(len(name) > 64 for name in names):
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "hello layout.rope.extra has too many or too long names")
        for name in names:
            if not math.isfinite(extra.float_(name, -1e30, 1e30)):
                raise RequestError(ErrorCode.INVALID_ARGUMENT, f"hello layout.rope.extra.{name} must be finite")
        extra.finish()
    rope.finish()
    scales = fields.optional_map("kv_scales")  # an fp8 layout's (KVScales)
    if scales is not None:
        for name in ("k", "v"):
            values = scales.list_(name, _MAX_LAYOUT_DIM)
            if any(type(value) not in (int, float) or not math.isfinite(float(value)) for value in values):  # type: ignore[arg-type]
                raise RequestError(ErrorCode.INVALID_ARGUMENT, f"hello layout.kv_scales.{name} must be finite numbers")
        scales.int_("heads", 1, _MAX_LAYOUT_DIM, optional=True)  # per-head scales: one a layer and KV head
        scales.finish()
    mla = fields.optional_map("mla")  # an MLA layout's (MLASpec)
    if mla is not None:
        for name in ("kv_lora_rank", "rope_dim"):
            mla.required_int(name, 1, _MAX_LAYOUT_DIM)
        mla.finish()
    fields.finish()
    try:
        return KVLayout.from_json(text)
    except (ConfigError, ValueError) as exc:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"hello layout: {exc}") from None


def tokens_to_wire(tokens: TokenArray) -> bytes:
    """Token ids (from ``as_token_array``) as the wire's little-endian uint32 bytes."""
    return tokens.astype("<u4", copy=False).tobytes()


def tokens_from_wire(fields: Fields, name: str, limits: Limits) -> TokenArray:
    """Read a token field: ``bin`` of little-endian uint32, at most ``limits.max_tokens`` of them."""
    raw = fields.bytes_(name, max_length=4 * limits.max_tokens, multiple_of=4)
    return np.frombuffer(raw, dtype="<u4").copy()


class BulkKind(enum.StrEnum):
    """How a request's KV bytes travel."""

    INLINE = "inline"
    SHM = "shm"
    CUDA_IPC = "cuda_ipc"


@dataclass(frozen=True, slots=True, kw_only=True)
class InlineBulk:
    """The KV is the message's payload frame (store) or the reply's (retrieve)."""

    def to_wire(self) -> dict[str, object]:
        return {"kind": BulkKind.INLINE.value}


@dataclass(frozen=True, slots=True, kw_only=True)
class ShmBulk:
    """The KV is ``nbytes`` at ``offset`` of a shared-memory segment the client attached.

    ``offset`` is a multiple of 64 bytes, so every dtype view of the region is aligned.
    """

    segment_id: int
    offset: int
    nbytes: int

    def to_wire(self) -> dict[str, object]:
        return {"kind": BulkKind.SHM.value, "segment_id": self.segment_id, "offset": self.offset, "nbytes": self.nbytes}


@dataclass(frozen=True, slots=True, kw_only=True)
class CudaIpcBulk:
    """The KV is a CUDA tensor another process shared by IPC handle (``cuda_ipc``)."""

    handle: CudaIpcHandle

    def to_wire(self) -> dict[str, object]:
        return {"kind": BulkKind.CUDA_IPC.value, "handle": self.handle.to_wire()}


BulkRef = InlineBulk | ShmBulk | CudaIpcBulk


def parse_bulk(fields: Fields) -> BulkRef:
    """Read a ``bulk`` map (finished here)."""
    kind_name = fields.required_str("kind", 16)
    try:
        kind = BulkKind(kind_name)
    except ValueError:
        raise RequestError(
            ErrorCode.INVALID_ARGUMENT, f"bulk kind {kind_name!r} is unknown; use inline, shm or cuda_ipc"
        ) from None
    bulk: BulkRef
    if kind is BulkKind.INLINE:
        bulk = InlineBulk()
    elif kind is BulkKind.SHM:
        offset = fields.required_int("offset", 0, _MAX_OFFSET)
        if offset % _SHM_ALIGN_BYTES:
            raise RequestError(
                ErrorCode.INVALID_ARGUMENT, f"bulk offset {offset} is not a multiple of {_SHM_ALIGN_BYTES} bytes"
            )
        bulk = ShmBulk(
            segment_id=fields.required_int("segment_id", 1, _MAX_SEGMENT_ID),
            offset=offset,
            nbytes=fields.required_int("nbytes", 0, _MAX_OFFSET),
        )
    else:
        bulk = CudaIpcBulk(handle=CudaIpcHandle.parse(fields.map_("handle", "bulk.handle")))
    fields.finish()
    return bulk


@dataclass(frozen=True, slots=True, kw_only=True)
class HelloArgs:
    """A client's registration: its layout (``None`` for an admin client), name, pid and host."""

    layout_json: str | None
    client_name: str
    pid: int
    host_id: str

    @classmethod
    def parse(cls, fields: Fields, limits: Limits) -> HelloArgs:
        parsed = cls(
            layout_json=fields.str_("layout", _MAX_LAYOUT_JSON_CHARS, optional=True),
            client_name=fields.required_str("client_name", _MAX_NAME_CHARS),
            pid=fields.required_int("pid", 0, 2**31 - 1),
            host_id=fields.str_("host_id", _MAX_HOST_ID_CHARS, allow_empty=True) or "",
        )
        fields.finish()
        return parsed

    def to_wire(self) -> dict[str, object]:
        return {"layout": self.layout_json, "client_name": self.client_name, "pid": self.pid, "host_id": self.host_id}


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreArgs:
    """Store the KV of ``tokens``; ``durable`` waits until it is committed and synced to disk.

    ``bulk`` holds the KV of ``tokens[start:]`` (``TieredStore.store(start=)``): ``start`` lies in
    ``[0, len(tokens)]`` (checked here); that it is a multiple of the chunk size is checked by the handler, which
    knows the chunk size.
    """

    tokens: TokenArray
    bulk: BulkRef
    durable: bool
    start: int = 0
    part: KVPart | None = None  # the bulk holds this part of the KV (a tensor- or pipeline-parallel rank's)

    @classmethod
    def parse(cls, fields: Fields, limits: Limits) -> StoreArgs:
        tokens = tokens_from_wire(fields, "tokens", limits)
        start = fields.int_("start", 0, len(tokens), optional=True) or 0
        parsed = cls(
            tokens=tokens,
            bulk=parse_bulk(fields.map_("bulk")),
            durable=fields.required_bool("durable"),
            start=start,
            part=parse_part(fields),
        )
        fields.finish()
        return parsed

    def to_wire(self) -> dict[str, object]:
        wire: dict[str, object] = {"tokens": tokens_to_wire(self.tokens), "bulk": self.bulk.to_wire()}
        wire["durable"] = self.durable
        if self.start:  # only when needed: a server from before the field refuses unknown fields
            wire["start"] = self.start
        if self.part is not None:
            wire["part"] = self.part.to_wire()
        return wire

    @property
    def num_bulk_tokens(self) -> int:
        """Tokens whose KV the bulk holds: ``len(tokens) - start``."""
        return len(self.tokens) - self.start


@dataclass(frozen=True, slots=True, kw_only=True)
class LookupArgs:
    """Plan a prompt; ``session_id`` scopes the plan's pins, ``blend`` overrides the server's default; ``pin=False``
    asks for a look only (the plan holds no pins: nothing to retrieve or release, one round trip); ``repeat``: the
    request's prompt was looked up before (``TieredStore.lookup``), so it is not counted again; ``partial``: the client
    reads slices (``Segment.is_slice``), so the plan may hold them (sent only to a server whose hello offers them)."""

    tokens: TokenArray
    session_id: str | None
    blend: bool | None
    pin: bool = True
    repeat: bool = False
    partial: bool = False

    @classmethod
    def parse(cls, fields: Fields, limits: Limits) -> LookupArgs:
        parsed = cls(
            tokens=tokens_from_wire(fields, "tokens", limits),
            session_id=fields.str_("session_id", _MAX_SESSION_CHARS, optional=True),
            blend=fields.bool_("blend", optional=True),
            pin=fields.bool_("pin", optional=True) is not False,
            repeat=fields.bool_("repeat", optional=True) is True,
            partial=fields.bool_("partial", optional=True) is True,
        )
        fields.finish()
        return parsed

    def to_wire(self) -> dict[str, object]:
        wire: dict[str, object] = {
            "tokens": tokens_to_wire(self.tokens),
            "session_id": self.session_id,
            "blend": self.blend,
        }
        if not self.pin:  # sent only when set: a pinned lookup reads the same to a server of any version
            wire["pin"] = False
        if self.repeat:
            wire["repeat"] = True
        if self.partial:
            wire["partial"] = True
        return wire


@dataclass(frozen=True, slots=True, kw_only=True)
class RetrieveArgs:
    """Load a plan's KV from token ``start`` into ``bulk`` (for shm: exactly ``layout.chunk_bytes(plan end - start)``
    bytes); with ``memory_only`` skip what only the disk holds (``TieredStore.retrieve``); ``owner``: the token of
    the client that looked the plan up, when that is another client of the server (a plan handed over: ``PlanArgs``).
    """

    plan_id: int
    bulk: BulkRef
    memory_only: bool = False
    owner: str | None = None
    start: int = 0
    part: KVPart | None = None  # only this part of each chunk (a rank's)
    readers: int = 1  # the ranks that each retrieve (or release) this plan: its pins go once all of them have

    @classmethod
    def parse(cls, fields: Fields, limits: Limits) -> RetrieveArgs:
        bulk = parse_bulk(fields.map_("bulk"))
        memory_only = bool(fields.bool_("memory_only", optional=True))
        parsed = cls(bulk=bulk, memory_only=memory_only, **_parse_plan_read(fields))
        fields.finish()
        return parsed

    def to_wire(self) -> dict[str, object]:
        wire = _plan_read_wire(self.plan_id, self.owner, self.start, self.part, self.readers)
        wire["bulk"] = self.bulk.to_wire()
        if self.memory_only:  # only when asked: a server from before the field refuses unknown fields
            wire["memory_only"] = True
        return wire


@dataclass(frozen=True, slots=True, kw_only=True)
class LendArgs:
    """Lend a plan's chunks from token ``start`` (``TieredStore.lend``): the reply names where each lies in the
    server's shared cpu arena (``ServerHello.lent_arena``), and the plan stays pinned until the caller returns it
    (``Op.RETURN`` with ``PlanArgs``). ``owner``, ``part`` and ``readers`` are a retrieve's (``RetrieveArgs``): the
    loan counts as one of the plan's ``readers`` once returned."""

    plan_id: int
    owner: str | None = None
    start: int = 0
    part: KVPart | None = None
    readers: int = 1

    @classmethod
    def parse(cls, fields: Fields, limits: Limits) -> LendArgs:
        parsed = cls(**_parse_plan_read(fields))
        fields.finish()
        return parsed

    def to_wire(self) -> dict[str, object]:
        return _plan_read_wire(self.plan_id, self.owner, self.start, self.part, self.readers)


def _parse_plan_read(fields: Fields) -> dict[str, Any]:
    """What a retrieve and a lend both name: the plan, its owner, the first token, the part and the readers."""
    return {
        "plan_id": fields.required_int("plan_id", 0, _MAX_PLAN_ID),
        "owner": fields.str_("owner", _MAX_CLIENT_TOKEN_CHARS, optional=True),
        "start": fields.int_("start", 0, _MAX_RETRIEVE_START, optional=True) or 0,
        "part": parse_part(fields),
        "readers": fields.int_("readers", 1, _MAX_READERS, optional=True) or 1,
    }


def _plan_read_wire(
    plan_id: int, owner: str | None, start: int, part: KVPart | None, readers: int
) -> dict[str, object]:
    """``_parse_plan_read``'s fields on the wire, each only when it is not its default (a server from before a
    field refuses it)."""
    wire: dict[str, object] = {"plan_id": plan_id}
    if owner is not None:
        wire["owner"] = owner
    if start:
        wire["start"] = start
    if part is not None:
        wire["part"] = part.to_wire()
    if readers != 1:
        wire["readers"] = readers
    return wire


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanArgs:
    """Names one plan (release): the client's own, or with ``owner`` another client's whose token the caller was
    given (one process looks up and pins, another retrieves or releases: an engine's scheduler and its worker). The
    token is the owner's secret (``hello``): knowing it is the permission. ``readers``: the plan is shared by that
    many ranks (``RetrieveArgs.readers``) and this is one of them that will not retrieve it."""

    plan_id: int
    owner: str | None = None
    readers: int = 1

    @classmethod
    def parse(cls, fields: Fields, limits: Limits) -> PlanArgs:
        parsed = cls(
            plan_id=fields.required_int("plan_id", 0, _MAX_PLAN_ID),
            owner=fields.str_("owner", _MAX_CLIENT_TOKEN_CHARS, optional=True),
            readers=fields.int_("readers", 1, _MAX_READERS, optional=True) or 1,
        )
        fields.finish()
        return parsed

    def to_wire(self) -> dict[str, object]:
        wire: dict[str, object] = {"plan_id": self.plan_id}
        if self.owner is not None:
            wire["owner"] = self.owner
        if self.readers != 1:
            wire["readers"] = self.readers
        return wire


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionArgs:
    """Names one session of the client (end_session)."""

    session_id: str

    @classmethod
    def parse(cls, fields: Fields, limits: Limits) -> SessionArgs:
        parsed = cls(session_id=fields.required_str("session_id", _MAX_SESSION_CHARS))
        fields.finish()
        return parsed

    def to_wire(self) -> dict[str, object]:
        return {"session_id": self.session_id}


@dataclass(frozen=True, slots=True, kw_only=True)
class EvictArgs:
    """Drop chunks by key (every tier), or free ``num_bytes`` of one tier (least recently used first)."""

    keys: tuple[PrefixKey, ...] | None = None
    num_bytes: int | None = None
    tier: TierName | None = None

    @classmethod
    def parse(cls, fields: Fields, limits: Limits) -> EvictArgs:
        if fields.has("keys"):
            raw_keys = fields.list_("keys", limits.max_keys)
            keys = []
            for index, key in enumerate(raw_keys):
                if type(key) is not bytes or len(key) != KEY_BYTES:
                    raise RequestError(
                        ErrorCode.INVALID_ARGUMENT, f"evict args: keys[{index}] must be a {KEY_BYTES}-byte bin"
                    )
                keys.append(PrefixKey(key))
            parsed = cls(keys=tuple(keys))
            fields.finish()
            return parsed
        num_bytes = fields.required_int("num_bytes", 0, 2**62)
        tier_name = fields.required_str("tier", 8)
        try:
            tier = TierName(tier_name)
        except ValueError:
            raise RequestError(
                ErrorCode.INVALID_ARGUMENT, f"evict args: tier {tier_name!r} is not one of gpu, cpu, disk"
            ) from None
        parsed = cls(num_bytes=num_bytes, tier=tier)
        fields.finish()
        return parsed

    def to_wire(self) -> dict[str, object]:
        if self.keys is not None:
            return {"keys": [bytes(key) for key in self.keys]}
        assert self.tier is not None, "EvictArgs needs keys, or num_bytes and a tier"
        return {"num_bytes": self.num_bytes, "tier": self.tier.value}


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkArgs:
    """Names one chunk by key (admin: where is it)."""

    key: PrefixKey

    @classmethod
    def parse(cls, fields: Fields, limits: Limits) -> ChunkArgs:
        parsed = cls(key=PrefixKey(fields.bytes_("key", max_length=KEY_BYTES, exact_length=KEY_BYTES)))
        fields.finish()
        return parsed

    def to_wire(self) -> dict[str, object]:
        return {"key": bytes(self.key)}


@dataclass(frozen=True, slots=True, kw_only=True)
class AttachArgs:
    """Map the shared-memory segment ``name`` (a sealed memfd the client created, ``nbytes`` long, open as the
    client's descriptor ``fd``) into the server."""

    name: str
    nbytes: int
    fd: int

    @classmethod
    def parse(cls, fields: Fields, limits: Limits) -> AttachArgs:
        parsed = cls(
            name=fields.required_str("name", 128),
            nbytes=fields.required_int("nbytes", 1, _MAX_OFFSET),
            fd=fields.required_int("fd", 0, 2**31 - 1),
        )
        fields.finish()
        return parsed

    def to_wire(self) -> dict[str, object]:
        return {"name": self.name, "nbytes": self.nbytes, "fd": self.fd}


@dataclass(frozen=True, slots=True, kw_only=True)
class DetachArgs:
    """Unmap a segment the client attached."""

    segment_id: int

    @classmethod
    def parse(cls, fields: Fields, limits: Limits) -> DetachArgs:
        parsed = cls(segment_id=fields.required_int("segment_id", 1, _MAX_SEGMENT_ID))
        fields.finish()
        return parsed

    def to_wire(self) -> dict[str, object]:
        return {"segment_id": self.segment_id}


def parse_part(fields: Fields) -> KVPart | None:
    """The optional ``part`` field: ``[layer_start, layer_end, head_start, head_end]`` (``KVPart``). Whether it lies
    inside the layout is checked by the handler, which knows the layout."""
    if not fields.has("part"):
        return None
    try:
        return KVPart.from_wire(fields.list_("part", 4))
    except InvalidInputError as exc:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, str(exc)) from None
