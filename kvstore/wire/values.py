"""Results on the wire: plans, store results, stats and the server's descriptions, both directions.

The server encodes the store's own values (``LookupPlan``, ``StoreResult``, ``StoreStats``) into msgpack maps; the
client decodes them back into the same classes, so code written against ``TieredStore`` runs unchanged against
``kvstore.Client``. A plan's segments travel as one ``bin`` of fixed-size little-endian rows, sorted by start::

    | start u64 | num_tokens u32 | source_start u64 | exact u8 | tier u8 | key (16 bytes) |
    0           8                12                 20         21        22               38

    exact: 0 or 1; tier: 0 gpu, 1 cpu, 2 disk; offsets in bytes

A slice (``Segment.is_slice``: rows ``[offset, offset + num_tokens)`` of its stored chunk) adds a row to a second
``bin``, ``<name>_slices``, sent only when the plan holds one; a segment without one is its whole chunk::

    | segment index u32 | offset u32 | chunk_tokens u32 |

A server plans slices only for a client that asks (lookup's ``partial``), and a client asks only a server whose hello
says it has them (``partial_segments``): neither side ever meets the rows it cannot read.

Why rows in one ``bin`` and not an array per segment: a 15k-token prompt has 60 segments, and packing or unpacking
60 six-item msgpack arrays and checking their 360 values one by one cost a lookup several times what rows cost, on
the two sides together (target: lookup p50 <= 1 ms; measured: docs/design-notes.md#wire-values); ``struct`` packs and
unpacks the rows in C. Gaps are derived from the segments; their reasons (``kvstore.misses``) travel as rows too::

    | start u64 | end u64 | reason u8 |      reason: the index in _REASON_BY_CODE (append only)

Decoding is strict (``Fields``, and each row checked): a server of
another version fails loudly, not subtly.

Pure functions and frozen values; thread-safe.
"""

from __future__ import annotations

import dataclasses
import struct
import typing
from dataclasses import dataclass

from kvstore.chunking import Chunking, parse_chunking
from kvstore.errors import ConfigError
from kvstore.keys import KEY_BYTES
from kvstore.layout import KVLayout
from kvstore.misses import Miss, MissReason
from kvstore.plan import Loan, LookupPlan, RetrieveResult, Segment, StoreResult
from kvstore.stats import CatalogStats, LookupTotals, RemoteStats, StoreStats
from kvstore.tiers.base import TierName, TierStats
from kvstore.wire.error_codes import ErrorCode, RequestError
from kvstore.wire.fields import Fields
from kvstore.wire.protocol import Limits

__all__ = [
    "ChunkHits",
    "ChunkInfo",
    "ClientSummary",
    "LentArena",
    "RetrievedSegments",
    "ServerFeatures",
    "ServerHealth",
    "ServerHello",
    "ServerInfo",
    "TierCapacity",
    "add_segments",
    "decode_segments",
    "decode_stats",
    "decode_store_result",
    "encode_loan",
    "encode_plan",
    "encode_retrieve_result",
    "encode_segments",
    "encode_slices",
    "encode_stats",
    "encode_store_result",
    "loan_from_wire",
    "plan_from_wire",
]

_MAX_SEGMENTS = 1 << 22
_MAX_POSITION = 2**40
_MAX_COUNT = 2**63 - 1
_SEGMENT_ROW = struct.Struct(f"<QIQBB{KEY_BYTES}s")  # start, num_tokens, source_start, exact, tier, key
_SLICE_ROW = struct.Struct("<III")  # segment index, offset, chunk_tokens
# The row's tier byte indexes this: never reorder.
_TIER_BY_CODE = (TierName.GPU, TierName.CPU, TierName.DISK, TierName.REMOTE)
_CODE_OF_TIER = {tier: code for code, tier in enumerate(_TIER_BY_CODE)}
_MISS_ROW = struct.Struct("<QQB")  # start, end, reason
# The row's reason byte indexes this: only ever append.
_REASON_BY_CODE = tuple(MissReason)
_CODE_OF_REASON = {reason: code for code, reason in enumerate(_REASON_BY_CODE)}
_SEGMENT_SLOT_SETTERS = tuple(
    getattr(Segment, name).__set__
    for name in ("start", "num_tokens", "key", "source_start", "exact", "tier", "offset", "chunk_tokens")
)  # in the order decode_segments unpacks them


# -- segments and plans -----------------------------------------------------------------------------------------


def encode_segments(segments: tuple[Segment, ...]) -> bytes:
    """Segments as the rows of the module docstring, in order."""
    pack, code_of_tier = _SEGMENT_ROW.pack, _CODE_OF_TIER
    return b"".join(
        [pack(s.start, s.num_tokens, s.source_start, s.exact, code_of_tier[s.tier], s.key) for s in segments]
    )


def encode_slices(segments: tuple[Segment, ...]) -> bytes:
    """The slice rows of ``segments`` (module docstring): empty when none is a slice."""
    pack = _SLICE_ROW.pack
    return b"".join(
        [pack(index, s.offset, s.chunk_tokens) for index, s in enumerate(segments) if s.chunk_tokens]
    )


def add_segments(wire: dict[str, object], name: str, segments: tuple[Segment, ...]) -> dict[str, object]:
    """``wire`` with ``segments`` under ``name``, and their slices under ``<name>_slices`` when there are any."""
    wire[name] = encode_segments(segments)
    slices = encode_slices(segments)
    if slices:  # only then: a client that did not ask for slices reads every reply it did before them
        wire[f"{name}_slices"] = slices
    return wire


def decode_segments(fields: Fields, name: str, num_query_tokens: int) -> tuple[Segment, ...]:
    """Read the segment rows, checking each row's values and that the segments are sorted and within the prompt.

    The ``Segment`` values are built by setting their slots (``_SEGMENT_SLOT_SETTERS``), not through the dataclass
    ``__init__``: a frozen, slotted, keyword-only ``__init__`` costs markedly more a segment, and a
    60-segment plan is rebuilt on the client of every lookup. ``Segment`` has no ``__post_init__`` to
    skip; ``tests/server/test_protocol.py`` checks that, and that both ways build equal values (a field added to
    ``Segment`` and not set here fails its comparison).
    """
    raw = fields.bytes_(name, max_length=_MAX_SEGMENTS * _SEGMENT_ROW.size, multiple_of=_SEGMENT_ROW.size)
    slices = _decode_slices(fields, f"{name}_slices", len(raw) // _SEGMENT_ROW.size)
    new_segment = object.__new__
    set_start, set_num_tokens, set_key, set_source_start, set_exact, set_tier, set_offset, set_chunk_tokens = (
        _SEGMENT_SLOT_SETTERS
    )
    segments: list[Segment] = []
    cursor = 0
    num_tiers = len(_TIER_BY_CODE)
    for index, (start, num_tokens, source_start, exact, tier, key) in enumerate(_SEGMENT_ROW.iter_unpack(raw)):
        if not (
            cursor <= start
            and num_tokens > 0
            and start + num_tokens <= num_query_tokens
            and source_start <= _MAX_POSITION
            and exact <= 1
            and tier < num_tiers
        ):
            row = (start, num_tokens, source_start, exact, tier, key.hex())
            raise RequestError(ErrorCode.MALFORMED, f"{name}[{index}] = {row!r} is not a valid segment")
        offset, chunk_tokens = slices.get(index, (0, 0))
        if chunk_tokens and offset + num_tokens > chunk_tokens:
            raise RequestError(
                ErrorCode.MALFORMED,
                f"{name}[{index}]: a slice of rows {offset}-{offset + num_tokens} of a {chunk_tokens}-token chunk",
            )
        segment = new_segment(Segment)
        set_start(segment, start)
        set_num_tokens(segment, num_tokens)
        set_key(segment, key)
        set_source_start(segment, source_start)
        set_exact(segment, exact == 1)
        set_tier(segment, _TIER_BY_CODE[tier])
        set_offset(segment, offset)
        set_chunk_tokens(segment, chunk_tokens)
        segments.append(segment)
        cursor = start + num_tokens
    return tuple(segments)


def _decode_slices(fields: Fields, name: str, num_segments: int) -> dict[int, tuple[int, int]]:
    """The slice rows (absent: none, or a server from before slices) by segment index, checked to rise and to name
    segments that exist."""
    if not fields.has(name):
        return {}
    raw = fields.bytes_(name, max_length=_MAX_SEGMENTS * _SLICE_ROW.size, multiple_of=_SLICE_ROW.size)
    slices: dict[int, tuple[int, int]] = {}
    previous = -1
    for row, (index, offset, chunk_tokens) in enumerate(_SLICE_ROW.iter_unpack(raw)):
        if not (previous < index < num_segments and chunk_tokens > 0):
            raise RequestError(
                ErrorCode.MALFORMED, f"{name}[{row}] = {(index, offset, chunk_tokens)!r} is not a valid slice"
            )
        slices[index] = (offset, chunk_tokens)
        previous = index
    return slices


def encode_misses(misses: tuple[Miss, ...]) -> bytes:
    """Misses as rows (module docstring), in order."""
    pack, code_of_reason = _MISS_ROW.pack, _CODE_OF_REASON
    return b"".join([pack(miss.start, miss.end, code_of_reason[miss.reason]) for miss in misses])


def decode_misses(fields: Fields, name: str, num_query_tokens: int) -> tuple[Miss, ...]:
    """Read the miss rows (absent: a server from before miss reasons), checking they are sorted, disjoint and
    within the prompt."""
    if not fields.has(name):
        return ()
    raw = fields.bytes_(name, max_length=_MAX_SEGMENTS * _MISS_ROW.size, multiple_of=_MISS_ROW.size)
    misses: list[Miss] = []
    cursor = 0
    for index, (start, end, code) in enumerate(_MISS_ROW.iter_unpack(raw)):
        if not (cursor <= start < end <= num_query_tokens and code < len(_REASON_BY_CODE)):
            raise RequestError(ErrorCode.MALFORMED, f"{name}[{index}] = {(start, end, code)!r} is not a valid miss")
        misses.append(Miss(start, end, _REASON_BY_CODE[code]))
        cursor = end
    return tuple(misses)


def encode_plan(plan: LookupPlan, session_id: str | None) -> dict[str, object]:
    """A plan as the client sees it: ``session_id`` is the client's own name for the session."""
    wire: dict[str, object] = {
        "plan_id": plan.plan_id,
        "session_id": session_id,
        "num_query_tokens": plan.num_query_tokens,
    }
    add_segments(wire, "segments", plan.segments)
    wire["misses"] = encode_misses(plan.misses)
    return wire


def plan_from_wire(fields: Fields) -> LookupPlan:
    """A lookup reply as a ``LookupPlan`` (no prefetch futures: the server waits for its own prefetches)."""
    plan_id = fields.required_int("plan_id", 0, _MAX_COUNT)
    session_id = fields.str_("session_id", 256, optional=True)
    num_query_tokens = fields.required_int("num_query_tokens", 0, _MAX_POSITION)
    segments = decode_segments(fields, "segments", num_query_tokens)
    misses = decode_misses(fields, "misses", num_query_tokens)
    fields.finish()
    return LookupPlan(
        plan_id=plan_id, session_id=session_id, num_query_tokens=num_query_tokens, segments=segments, misses=misses
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class RetrievedSegments:
    """A retrieve reply: the segments loaded, the prompt length, the tokens of KV written (``end``) and the
    misses with their reasons."""

    segments: tuple[Segment, ...]
    num_query_tokens: int
    end: int
    misses: tuple[Miss, ...] = ()

    @classmethod
    def from_wire(cls, fields: Fields) -> RetrievedSegments:
        num_query_tokens = fields.required_int("num_query_tokens", 0, _MAX_POSITION)
        segments = decode_segments(fields, "segments", num_query_tokens)
        end = fields.required_int("end", 0, num_query_tokens)
        misses = decode_misses(fields, "misses", num_query_tokens)
        fields.finish()
        if end != (segments[-1].end if segments else 0):
            raise RequestError(ErrorCode.MALFORMED, f"retrieve reply end={end} disagrees with its segments")
        return cls(segments=segments, num_query_tokens=num_query_tokens, end=end, misses=misses)


def loan_from_wire(fields: Fields, start: int) -> Loan | None:
    """A lend reply (``encode_loan``) for a lend from ``start``; ``None`` when the server did not lend the plan (the
    caller retrieves it)."""
    if not fields.required_bool("lent"):
        fields.finish()
        return None
    num_query_tokens = fields.required_int("num_query_tokens", 0, _MAX_POSITION)
    segments = decode_segments(fields, "segments", num_query_tokens)
    offsets = fields.list_("offsets", _MAX_SEGMENTS)
    misses = decode_misses(fields, "misses", num_query_tokens)
    fields.finish()
    if len(offsets) != len(segments) or any(type(o) is not int or not 0 <= o < _MAX_POSITION for o in offsets):
        raise RequestError(ErrorCode.MALFORMED, "lend reply offsets are not one byte offset per segment")
    if any(segment.end <= start for segment in segments):
        raise RequestError(ErrorCode.MALFORMED, f"lend reply names a segment that ends by its start {start}")
    return Loan(
        segments=segments,
        offsets=tuple(offsets),  # type: ignore[arg-type]
        num_query_tokens=num_query_tokens,
        start=start,
        misses=misses,
    )


def encode_loan(loan: Loan | None) -> dict[str, object]:
    """A lend reply: ``{"lent": False}`` when there is no loan."""
    if loan is None:
        return {"lent": False}
    wire = add_segments({"lent": True}, "segments", loan.segments)
    wire["offsets"] = list(loan.offsets)
    wire["num_query_tokens"] = loan.num_query_tokens
    wire["misses"] = encode_misses(loan.misses)
    return wire


def encode_retrieve_result(result: RetrieveResult) -> dict[str, object]:
    wire = add_segments({}, "segments", result.segments)
    wire["num_query_tokens"] = result.num_query_tokens
    wire["end"] = result.segments[-1].end if result.segments else 0
    wire["misses"] = encode_misses(result.misses)
    return wire


# -- store results and stats ------------------------------------------------------------------------------------


_STORE_RESULT_COUNTS = ("num_chunks", "num_new_chunks", "num_rejected_chunks", "num_aliased_chunks")
"""The fields of a ``StoreResult`` a reply carries: its counts (``chunks`` stays in the server)."""


def encode_store_result(result: StoreResult) -> dict[str, object]:
    return {name: getattr(result, name) for name in _STORE_RESULT_COUNTS}


def decode_store_result(fields: Fields) -> StoreResult:
    num_chunks, num_new_chunks, num_rejected_chunks, num_aliased_chunks = (
        fields.required_int(name, 0, _MAX_COUNT) for name in _STORE_RESULT_COUNTS
    )
    fields.finish()
    return StoreResult(
        num_chunks=num_chunks,
        num_new_chunks=num_new_chunks,
        num_rejected_chunks=num_rejected_chunks,
        num_aliased_chunks=num_aliased_chunks,
    )


def _encode_record(value: object) -> dict[str, object]:
    """A frozen dataclass of ints, strings, bools and nested dataclasses as a map."""
    out: dict[str, object] = {}
    for field in dataclasses.fields(value):  # type: ignore[arg-type]
        item = getattr(value, field.name)
        out[field.name] = _encode_record(item) if dataclasses.is_dataclass(item) else item
    return out


def _decode_record(cls: type[typing.Any], fields: Fields, *, newer_fields: bool = False) -> typing.Any:
    """The inverse of ``_encode_record`` for dataclasses whose fields are ints, enums or nested dataclasses.
    ``newer_fields``: ignore fields ``cls`` does not have (what a newer server describes itself with)."""
    hints = typing.get_type_hints(cls)
    values: dict[str, object] = {}
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            values[field.name] = _decode_record(hint, fields.map_(field.name))  # type: ignore[arg-type]
        elif hint is TierName:
            values[field.name] = TierName(fields.required_str(field.name, 8))
        elif hint is float:
            values[field.name] = fields.float_(field.name, 0.0, float(_MAX_COUNT))
        elif hint is bool:
            values[field.name] = fields.required_bool(field.name)
        else:
            values[field.name] = fields.required_int(field.name, 0, _MAX_COUNT)
    if not newer_fields:
        fields.finish()
    return cls(**values)


def encode_stats(stats: StoreStats) -> dict[str, object]:
    return {
        "tiers": [_encode_record(tier) for tier in stats.tiers],
        "num_open_plans": stats.num_open_plans,
        "num_sessions": stats.num_sessions,
        "catalog": _encode_record(stats.catalog) if stats.catalog is not None else None,
        "remote": _encode_record(stats.remote) if stats.remote is not None else None,
        "lookups": {"looked_up_tokens": stats.lookups.looked_up_tokens, "missed_tokens": stats.lookups.missed_tokens},
    }


def decode_stats(fields: Fields) -> StoreStats:
    tiers = tuple(
        _decode_record(TierStats, Fields(raw, f"stats.tiers[{index}]"))
        for index, raw in enumerate(fields.list_("tiers", len(TierName)))
    )
    num_open_plans = fields.required_int("num_open_plans", 0, _MAX_COUNT)
    num_sessions = fields.required_int("num_sessions", 0, _MAX_COUNT)
    catalog_fields = fields.optional_map("catalog")
    catalog = _decode_record(CatalogStats, catalog_fields) if catalog_fields is not None else None
    remote_fields = fields.optional_map("remote")
    remote = _decode_record(RemoteStats, remote_fields) if remote_fields is not None else None
    lookups_fields = fields.optional_map("lookups")
    lookups = _decode_lookup_totals(lookups_fields) if lookups_fields is not None else LookupTotals()
    fields.finish()
    return StoreStats(
        tiers=tiers,
        num_open_plans=num_open_plans,
        num_sessions=num_sessions,
        catalog=catalog,
        remote=remote,
        lookups=lookups,
    )


def _decode_lookup_totals(fields: Fields) -> LookupTotals:
    looked_up_tokens = fields.required_int("looked_up_tokens", 0, _MAX_COUNT)
    missed = fields.map_("missed_tokens")
    # reasons are read as strings, so an older client reads a newer server's reasons
    missed_tokens = {reason: missed.required_int(reason, 0, _MAX_COUNT) for reason in missed.names()}
    missed.finish()
    fields.finish()
    return LookupTotals(looked_up_tokens=looked_up_tokens, missed_tokens=missed_tokens)


# -- descriptions of the server ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class TierCapacity:
    """One tier of a server and its capacity in bytes."""

    tier: TierName
    capacity_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerFeatures:
    """What a server was started with, and which bulk transports it offers."""

    blend: bool
    segmented_prefix: bool
    dedup_content: bool
    shm: bool
    cuda_ipc: bool

    def to_wire(self) -> dict[str, object]:
        return _encode_record(self)

    @classmethod
    def from_wire(cls, fields: Fields) -> ServerFeatures:
        """A newer server's features this client predates are ignored (it uses none of them)."""
        return cls(**{field.name: fields.required_bool(field.name) for field in dataclasses.fields(cls)})


def _tiers_to_wire(tiers: tuple[TierCapacity, ...]) -> list[dict[str, object]]:
    return [{"tier": t.tier.value, "capacity_bytes": t.capacity_bytes} for t in tiers]


def _tiers_from_wire(fields: Fields, name: str) -> tuple[TierCapacity, ...]:
    return tuple(
        _decode_record(TierCapacity, Fields(raw, f"{name}[{index}]")) for index, raw in enumerate(fields.list_(name, 3))
    )


def _chunk_separator_from_wire(fields: Fields) -> tuple[int, ...]:
    separator = fields.list_("chunk_separator", 64)
    if any(type(token) is not int or not 0 <= token < 2**32 for token in separator):
        raise RequestError(ErrorCode.MALFORMED, f"hello chunk_separator {separator!r:.100} is not token ids")
    return tuple(separator)  # type: ignore[arg-type]


def _chunking_from_wire(fields: Fields) -> Chunking:
    """The server's cut rule; a server from before the rule existed sends none and cuts ``fixed``."""
    text = fields.str_("chunking", 16, optional=True)
    if text is None:
        return Chunking.FIXED
    try:
        return parse_chunking(text)
    except ConfigError:
        raise RequestError(ErrorCode.MALFORMED, f"chunking {text!r} is not one of fixed, content") from None


def _layout_from_wire(fields: Fields, name: str) -> KVLayout | None:
    text = fields.str_(name, 64 * 1024, optional=True)
    return KVLayout.from_json(text) if text is not None else None


@dataclass(frozen=True, slots=True, kw_only=True)
class LentArena:
    """The server's shared cpu arena, for a client on its host to map read-only (``kvstore.wire.shm``): the memory
    file's name and size, and the server's pid and descriptor to open it through ``/proc``."""

    name: str
    nbytes: int
    pid: int
    fd: int

    def to_wire(self) -> dict[str, object]:
        return {"name": self.name, "nbytes": self.nbytes, "pid": self.pid, "fd": self.fd}

    @classmethod
    def from_wire(cls, fields: Fields) -> LentArena:
        arena = cls(
            name=fields.required_str("name", 64),
            nbytes=fields.required_int("nbytes", 1, _MAX_POSITION),
            pid=fields.required_int("pid", 1, 2**31),
            fd=fields.required_int("fd", 0, 2**31),
        )
        fields.finish()
        return arena


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerHello:
    """The hello reply: the client's token and what the server is."""

    client_id: str
    server_version: str
    layout: KVLayout | None
    chunk_size: int
    tiers: tuple[TierCapacity, ...]
    features: ServerFeatures
    limits: Limits
    host_id: str
    chunk_separator: tuple[int, ...] = ()
    chunking: Chunking = Chunking.FIXED
    partial_segments: bool = False  # plans slices for a lookup that asks (``LookupArgs.partial``)
    lent_arena: LentArena | None = None  # only to a client on the server's host, when the cpu tier is shared

    def to_wire(self) -> dict[str, object]:
        wire: dict[str, object] = {
            "client_id": self.client_id,
            "server_version": self.server_version,
            "layout": self.layout.to_json() if self.layout is not None else None,
            "chunk_size": self.chunk_size,
            "chunk_separator": list(self.chunk_separator),
            "chunking": self.chunking.value,
            "partial_segments": self.partial_segments,
            "tiers": _tiers_to_wire(self.tiers),
            "features": self.features.to_wire(),
            "limits": _encode_record(self.limits),
            "host_id": self.host_id,
        }
        if self.lent_arena is not None:  # absent otherwise: a client before lending reads nothing new
            wire["lent_arena"] = self.lent_arena.to_wire()
        return wire

    @classmethod
    def from_wire(cls, fields: Fields) -> ServerHello:
        arena = fields.optional_map("lent_arena")
        hello = cls(
            client_id=fields.required_str("client_id", 64),
            server_version=fields.required_str("server_version", 64),
            layout=_layout_from_wire(fields, "layout"),
            chunk_size=fields.required_int("chunk_size", 1, 2**31),
            tiers=_tiers_from_wire(fields, "tiers"),
            features=ServerFeatures.from_wire(fields.map_("features")),
            limits=_decode_record(Limits, fields.map_("limits"), newer_fields=True),
            host_id=fields.str_("host_id", 256, allow_empty=True) or "",
            chunk_separator=_chunk_separator_from_wire(fields),
            chunking=_chunking_from_wire(fields),
            partial_segments=fields.bool_("partial_segments", optional=True) is True,  # absent: a server before them
            lent_arena=LentArena.from_wire(arena) if arena is not None else None,
        )
        # No fields.finish(): a server newer than this client may describe more of itself (a capability it offers,
        # which the client then never asks for), and refusing it would stop every older client at a rolling upgrade.
        return hello


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerHealth:
    """The health reply (also served as ``/healthz``)."""

    status: str
    uptime_s: float
    layout_registered: bool
    server_version: str

    def to_wire(self) -> dict[str, object]:
        return _encode_record(self)

    @classmethod
    def from_wire(cls, fields: Fields) -> ServerHealth:
        health = cls(
            status=fields.required_str("status", 32),
            uptime_s=fields.float_("uptime_s", 0.0, 1e12),
            layout_registered=fields.required_bool("layout_registered"),
            server_version=fields.required_str("server_version", 64),
        )
        fields.finish()
        return health


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientSummary:
    """One connected client, as ``kvstore inspect --url`` lists it."""

    client_id: str
    name: str
    pid: int
    local: bool
    num_open_plans: int
    num_sessions: int
    num_segments: int

    def to_wire(self) -> dict[str, object]:
        return _encode_record(self)

    @classmethod
    def from_wire(cls, fields: Fields) -> ClientSummary:
        summary = cls(
            client_id=fields.required_str("client_id", 64),
            name=fields.required_str("name", 128),
            pid=fields.required_int("pid", 0, 2**31),
            local=fields.required_bool("local"),
            num_open_plans=fields.required_int("num_open_plans", 0, _MAX_COUNT),
            num_sessions=fields.required_int("num_sessions", 0, _MAX_COUNT),
            num_segments=fields.required_int("num_segments", 0, _MAX_COUNT),
        )
        fields.finish()
        return summary


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkHits:
    """A chunk key and how many lookups planned it since the server started."""

    key: str
    hits: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerInfo:
    """Settings and state of a running server (``info``)."""

    server_version: str
    pid: int
    uptime_s: float
    layout: KVLayout | None
    chunk_size: int
    tiers: tuple[TierCapacity, ...]
    features: ServerFeatures
    data_dir: str | None
    num_requests: int
    clients: tuple[ClientSummary, ...]
    top_chunks: tuple[ChunkHits, ...]
    chunk_separator: tuple[int, ...] = ()
    chunking: Chunking = Chunking.FIXED

    def to_wire(self) -> dict[str, object]:
        return {
            "server_version": self.server_version,
            "pid": self.pid,
            "uptime_s": self.uptime_s,
            "layout": self.layout.to_json() if self.layout is not None else None,
            "chunk_size": self.chunk_size,
            "chunk_separator": list(self.chunk_separator),
            "chunking": self.chunking.value,
            "tiers": _tiers_to_wire(self.tiers),
            "features": self.features.to_wire(),
            "data_dir": self.data_dir,
            "num_requests": self.num_requests,
            "clients": [client.to_wire() for client in self.clients],
            "top_chunks": [[chunk.key, chunk.hits] for chunk in self.top_chunks],
        }

    @classmethod
    def from_wire(cls, fields: Fields) -> ServerInfo:
        top_chunks = []
        for raw in fields.list_("top_chunks", 10_000):
            if not (isinstance(raw, list) and len(raw) == 2 and type(raw[0]) is str and type(raw[1]) is int):
                raise RequestError(ErrorCode.MALFORMED, f"info top_chunks item {raw!r:.100} is not [key, hits]")
            top_chunks.append(ChunkHits(key=raw[0], hits=raw[1]))
        info = cls(
            server_version=fields.required_str("server_version", 64),
            pid=fields.required_int("pid", 0, 2**31),
            uptime_s=fields.float_("uptime_s", 0.0, 1e12),
            layout=_layout_from_wire(fields, "layout"),
            chunk_size=fields.required_int("chunk_size", 1, 2**31),
            chunk_separator=_chunk_separator_from_wire(fields),
            chunking=_chunking_from_wire(fields),
            tiers=_tiers_from_wire(fields, "tiers"),
            features=ServerFeatures.from_wire(fields.map_("features")),
            data_dir=fields.str_("data_dir", 4096, optional=True),
            num_requests=fields.required_int("num_requests", 0, _MAX_COUNT),
            clients=tuple(
                ClientSummary.from_wire(Fields(raw, "info.clients[]")) for raw in fields.list_("clients", 100_000)
            ),
            top_chunks=tuple(top_chunks),
        )
        fields.finish()
        return info


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkInfo:
    """Where one chunk is (``kvstore inspect --url ... --key``)."""

    key: str
    tiers: tuple[TierName, ...]
    hits: int

    def to_wire(self) -> dict[str, object]:
        return {"key": self.key, "tiers": [tier.value for tier in self.tiers], "hits": self.hits}

    @classmethod
    def from_wire(cls, fields: Fields) -> ChunkInfo:
        key = fields.required_str("key", 2 * KEY_BYTES)
        raw_tiers = fields.list_("tiers", 3)
        if any(tier not in ("gpu", "cpu", "disk") for tier in raw_tiers):
            raise RequestError(ErrorCode.MALFORMED, f"chunk tiers {raw_tiers!r} are not tier names")
        tiers = tuple(TierName(str(tier)) for tier in raw_tiers)
        info = cls(key=key, tiers=tiers, hits=fields.required_int("hits", 0, _MAX_COUNT))
        fields.finish()
        return info
