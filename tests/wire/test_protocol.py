"""The wire format in-process: valid messages round-trip, every kind of bad message is a ``RequestError`` with a
code and one line, never another exception."""

from __future__ import annotations

import dataclasses
import json
import struct

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.chunking import Chunking
from kvstore.keys import PrefixKey, as_token_array
from kvstore.layout import KVLayout
from kvstore.plan import ChunkOutcome, ChunkResult, Loan, LookupPlan, RetrieveResult, Segment, StoreResult
from kvstore.tiers.base import TierName
from kvstore.wire.error_codes import ErrorCode, RequestError, exception_for
from kvstore.wire.fields import Fields
from kvstore.wire.messages import (
    EvictArgs,
    HelloArgs,
    InlineBulk,
    LookupArgs,
    RetrieveArgs,
    ShmBulk,
    StoreArgs,
    layout_from_json,
)
from kvstore.wire.protocol import (
    PROTOCOL_VERSION,
    Limits,
    Op,
    decode_reply,
    decode_request,
    encode_error,
    encode_ok,
    encode_request,
)
from kvstore.wire.values import (
    LentArena,
    RetrievedSegments,
    ServerFeatures,
    ServerHello,
    TierCapacity,
    decode_store_result,
    encode_loan,
    encode_plan,
    encode_retrieve_result,
    encode_segments,
    encode_store_result,
    loan_from_wire,
    plan_from_wire,
)

LIMITS = Limits(max_header_bytes=1 << 16, max_payload_bytes=1 << 20, max_tokens=1000, max_keys=4)


def frames(*parts: bytes) -> list[memoryview]:
    return [memoryview(part) for part in parts]


def header(**overrides: object) -> bytes:
    value: dict[str, object] = {"v": PROTOCOL_VERSION, "id": 7, "op": "health", "client": None, "args": {}}
    value.update(overrides)
    return msgpack.packb({k: v for k, v in value.items() if v is not ...})


def rejected(parts: list[memoryview]) -> RequestError:
    with pytest.raises(RequestError) as caught:
        decode_request(parts, LIMITS)
    error = caught.value
    assert "\n" not in error.message and error.message
    return error


def test_a_valid_request_round_trips() -> None:
    args = LookupArgs(tokens=as_token_array([1, 2, 3]), session_id="s", blend=None)
    request = decode_request(frames(encode_request(5, Op.LOOKUP, "abc", args.to_wire())), LIMITS)
    assert (request.request_id, request.op, request.client_id) == (5, Op.LOOKUP, "abc")
    parsed = LookupArgs.parse(request.args, LIMITS)
    request.args.finish()
    assert parsed.tokens.tolist() == [1, 2, 3] and parsed.session_id == "s" and parsed.blend is None


@pytest.mark.parametrize(
    ("parts", "code"),
    [
        ([], ErrorCode.MALFORMED),
        ([b"a", b"b", b"c"], ErrorCode.MALFORMED),
        ([b"\xc1"], ErrorCode.MALFORMED),  # never-used msgpack byte
        ([header()[:-3]], ErrorCode.MALFORMED),  # truncated
        ([header() + b"\x00"], ErrorCode.MALFORMED),  # trailing bytes
        ([msgpack.packb([1, 2])], ErrorCode.MALFORMED),  # not a map
        ([msgpack.packb({1: 2})], ErrorCode.MALFORMED),  # int keys
        ([b"\x91" * 50_000], ErrorCode.MALFORMED),  # nesting bomb
        ([header(v=1)], ErrorCode.UNSUPPORTED_VERSION),  # a client from before issue 5's segment rows
        ([header(v=PROTOCOL_VERSION + 1)], ErrorCode.UNSUPPORTED_VERSION),
        ([header(v=True)], ErrorCode.UNSUPPORTED_VERSION),
        ([header(v=...)], ErrorCode.UNSUPPORTED_VERSION),
        ([header(op="fly")], ErrorCode.UNKNOWN_OP),
        ([header(op=3)], ErrorCode.INVALID_ARGUMENT),
        ([header(id=-1)], ErrorCode.INVALID_ARGUMENT),
        ([header(id="7")], ErrorCode.INVALID_ARGUMENT),
        ([header(args=[])], ErrorCode.INVALID_ARGUMENT),
        ([header(client=b"bytes")], ErrorCode.INVALID_ARGUMENT),
        ([header(extra=1)], ErrorCode.INVALID_ARGUMENT),
        ([b"\x00" * (LIMITS.max_header_bytes + 1)], ErrorCode.TOO_LARGE),
        ([header(), b"\x00" * (LIMITS.max_payload_bytes + 1)], ErrorCode.TOO_LARGE),
    ],
)
def test_bad_frames_and_headers_are_request_errors(parts: list[bytes], code: ErrorCode) -> None:
    assert rejected(frames(*parts)).code is code


def test_the_request_id_is_kept_when_it_could_be_read() -> None:
    assert rejected(frames(header(op="fly", id=99))).request_id == 99
    assert rejected(frames(b"\xc1")).request_id is None


def parse_args(kind: type, raw: dict[str, object]) -> object:
    fields = Fields(raw, "args")
    value = kind.parse(fields, LIMITS)  # type: ignore[attr-defined]
    fields.finish()
    return value


@pytest.mark.parametrize(
    ("kind", "raw", "fragment"),
    [
        (LookupArgs, {"tokens": b"\x00" * 5, "session_id": None, "blend": None}, "multiple of 4"),
        (LookupArgs, {"tokens": b"\x00" * 4004, "session_id": None, "blend": None}, "at most 4,000"),
        (LookupArgs, {"tokens": [1, 2], "session_id": None, "blend": None}, "must be bin"),
        (LookupArgs, {"tokens": b"", "session_id": 5, "blend": None}, "must be a str"),
        (LookupArgs, {"tokens": b"", "session_id": "", "blend": None}, "is empty"),
        (LookupArgs, {"tokens": b"", "session_id": None, "blend": 1}, "must be a bool"),
        (LookupArgs, {"session_id": None, "blend": None}, "missing field"),
        (LookupArgs, {"tokens": b"", "session_id": None, "blend": None, "x": 1}, "unknown field"),
        (StoreArgs, {"tokens": b"", "bulk": {"kind": "carrier pigeon"}, "durable": False}, "kind"),
        (
            StoreArgs,
            {"tokens": b"", "bulk": {"kind": "shm", "segment_id": 1, "offset": 3, "nbytes": 0}, "durable": False},
            "multiple of 64",
        ),
        (
            StoreArgs,
            {"tokens": b"", "bulk": {"kind": "shm", "segment_id": 0, "offset": 0, "nbytes": 0}, "durable": False},
            "out of range",
        ),
        (StoreArgs, {"tokens": b"", "bulk": {"kind": "inline", "more": 1}, "durable": False}, "unknown field"),
        (StoreArgs, {"tokens": b"", "bulk": "inline", "durable": False}, "must be a map"),
        (RetrieveArgs, {"plan_id": 1.5, "bulk": {"kind": "inline"}}, "must be an int"),
        (EvictArgs, {"keys": [b"short"]}, "16-byte"),
        (EvictArgs, {"keys": [b"k" * 16] * 5}, "at most 4"),
        (EvictArgs, {"num_bytes": 10, "tier": "tape"}, "not one of"),
        (HelloArgs, {"layout": None, "client_name": "x" * 200, "pid": 1, "host_id": ""}, "at most 128"),
        (HelloArgs, {"layout": None, "client_name": "x", "pid": 2**40, "host_id": ""}, "out of range"),
    ],
)
def test_bad_arguments_name_the_field(kind: type, raw: dict[str, object], fragment: str) -> None:
    with pytest.raises(RequestError) as caught:
        parse_args(kind, raw)
    assert caught.value.code is ErrorCode.INVALID_ARGUMENT and fragment in caught.value.message


def test_arguments_round_trip(small_layout: KVLayout) -> None:
    tokens = as_token_array(np.arange(10))
    store = StoreArgs(tokens=tokens, bulk=ShmBulk(segment_id=3, offset=128, nbytes=99), durable=True)
    parsed = parse_args(StoreArgs, msgpack.unpackb(msgpack.packb(store.to_wire())))
    assert isinstance(parsed, StoreArgs) and parsed.bulk == store.bulk and parsed.tokens.tolist() == list(range(10))
    evict = EvictArgs(keys=(PrefixKey(b"k" * 16),))
    assert parse_args(EvictArgs, evict.to_wire()) == evict
    retrieve = RetrieveArgs(plan_id=4, bulk=InlineBulk())
    assert parse_args(RetrieveArgs, retrieve.to_wire()) == retrieve


def test_layouts_are_checked_field_by_field(small_layout: KVLayout) -> None:
    assert layout_from_json(small_layout.to_json()) == small_layout
    good = json.loads(small_layout.to_json())
    bad_variants = [
        "not json",
        json.dumps([1]),
        json.dumps(good | {"model_id": 5}),
        json.dumps(good | {"num_layers": 0}),
        json.dumps(good | {"num_layers": 10**9}),
        json.dumps(good | {"dtype": "int4"}),
        json.dumps(good | {"extra": 1}),
        json.dumps(good | {"rope": good["rope"] | {"theta": float("nan")}}),
        json.dumps(good | {"rope": good["rope"] | {"scaling": "dynamic"}}),  # yarn is stored (MLA), dynamic is not
    ]
    for text in bad_variants:
        with pytest.raises(RequestError) as caught:
            layout_from_json(text)
        assert caught.value.code is ErrorCode.INVALID_ARGUMENT, text


def test_replies_round_trip_and_errors_map_to_the_store_errors() -> None:
    ok = decode_reply(frames(encode_ok(3, {"a": 1})))
    assert ok.ok and ok.request_id == 3 and ok.result is not None and ok.result.required_int("a", 0, 9) == 1
    error = decode_reply(frames(encode_error(None, ErrorCode.LAYOUT_MISMATCH, "two\nlines")))
    assert not error.ok and error.error_code == "layout_mismatch" and error.error_message == "two lines"
    from kvstore.errors import ConfigError, LayoutMismatchError, ProtocolError

    assert isinstance(exception_for("layout_mismatch", "m"), LayoutMismatchError)
    assert isinstance(exception_for("unknown_plan", "m"), ConfigError)
    assert isinstance(exception_for("from the future", "m"), ProtocolError)


def test_plans_and_store_results_round_trip() -> None:
    key = PrefixKey(bytes(range(16)))
    segments = (
        Segment(start=0, num_tokens=4, key=key, source_start=0, exact=True, tier=TierName.CPU),
        Segment(start=6, num_tokens=4, key=key, source_start=20, exact=False, tier=TierName.DISK),
    )
    plan = LookupPlan(plan_id=9, session_id="internal", num_query_tokens=12, segments=segments)
    decoded = plan_from_wire(Fields(msgpack.unpackb(msgpack.packb(encode_plan(plan, "mine"))), "plan"))
    assert decoded.segments == segments and decoded.session_id == "mine" and decoded.gaps == plan.gaps
    result = StoreResult(num_chunks=3, num_new_chunks=2, num_rejected_chunks=1, num_aliased_chunks=0)
    assert decode_store_result(Fields(encode_store_result(result), "r")) == result
    chunks = (
        ChunkResult(key=key, start=0, end=4, outcome=ChunkOutcome.WRITTEN),
        ChunkResult(key=key, start=4, end=8, outcome=ChunkOutcome.REJECTED),
    )
    per_chunk = StoreResult.of(chunks)
    assert encode_store_result(per_chunk) == {
        "num_chunks": 2, "num_new_chunks": 1, "num_rejected_chunks": 1, "num_aliased_chunks": 0,
    }, "the reply carries the counts only: the per-chunk outcomes stay in the server"  # fmt: skip
    overlapping = (segments[0], dataclasses.replace(segments[1], start=2))
    with pytest.raises(RequestError) as caught:
        plan_from_wire(Fields(encode_plan(plan, None) | {"segments": encode_segments(overlapping)}, "plan"))
    assert caught.value.code is ErrorCode.MALFORMED and "segments[1]" in caught.value.message


def test_slices_travel_beside_the_rows_only_when_a_plan_has_one() -> None:
    """A slice's offset and chunk length go in a second ``bin`` that a plan without slices does not send (a client
    that never asked for slices reads every reply as before); a slice row naming no segment, out of order, or more
    rows than its chunk holds is malformed."""
    key = PrefixKey(bytes(range(16)))
    whole = Segment(start=0, num_tokens=4, key=key, source_start=0, exact=True, tier=TierName.CPU)
    sliced = Segment(start=6, num_tokens=5, key=key, source_start=23, exact=False, tier=TierName.DISK, offset=3,
                     chunk_tokens=9)  # fmt: skip
    plan = LookupPlan(plan_id=9, session_id=None, num_query_tokens=12, segments=(whole, sliced))
    wire = msgpack.unpackb(msgpack.packb(encode_plan(plan, None)))
    decoded = plan_from_wire(Fields(dict(wire), "plan")).segments
    assert decoded == (whole, sliced) and decoded[1].is_slice and not decoded[0].is_slice
    assert decoded[1].stored_tokens == 9 and decoded[0].stored_tokens == 4
    assert "segments_slices" not in encode_plan(dataclasses.replace(plan, segments=(whole,)), None)
    result = RetrieveResult(segments=(whole, sliced), num_query_tokens=12, kv=torch.empty(0))
    assert RetrievedSegments.from_wire(Fields(encode_retrieve_result(result), "retrieve")).segments == (whole, sliced)
    for rows in ([(2, 0, 9)], [(1, 0, 9), (1, 0, 9)], [(1, 0, 0)], [(1, 5, 9)]):
        corrupt = wire | {"segments_slices": b"".join(struct.pack("<III", *row) for row in rows)}
        with pytest.raises(RequestError) as caught:
            plan_from_wire(Fields(corrupt, "plan"))
        assert caught.value.code is ErrorCode.MALFORMED and "segments" in caught.value.message


def test_a_lookup_asks_for_slices_only_when_it_reads_them() -> None:
    tokens = as_token_array([1, 2, 3])
    assert "partial" not in LookupArgs(tokens=tokens, session_id=None, blend=None).to_wire(), "an older server"
    asking = LookupArgs(tokens=tokens, session_id=None, blend=None, partial=True).to_wire()
    assert LookupArgs.parse(Fields(asking, "args"), LIMITS).partial
    assert not LookupArgs.parse(Fields(LookupArgs(tokens=tokens, session_id=None, blend=None).to_wire(), "a"),
                                LIMITS).partial  # fmt: skip


def _sliced(segment: Segment, offset: int, rest: int | None) -> Segment:
    """``segment`` as rows ``[offset, offset + num_tokens)`` of a chunk ``rest`` rows longer (``None``: whole)."""
    if rest is None:
        return segment
    return dataclasses.replace(segment, offset=offset, chunk_tokens=offset + segment.num_tokens + rest)


_segment_lists = st.lists(
    st.builds(
        _sliced,
        st.builds(
            Segment,
            start=st.integers(0, 2**36),
            num_tokens=st.integers(1, 2**31),
            key=st.binary(min_size=16, max_size=16).map(PrefixKey),
            source_start=st.integers(0, 2**40),
            exact=st.booleans(),
            tier=st.sampled_from(TierName),
        ),
        st.integers(0, 2**20),
        st.none() | st.integers(0, 2**20),
    ),
    max_size=8,
).map(lambda drawn: tuple(sorted(drawn, key=lambda segment: segment.start)))


def test_the_segment_decoder_skips_no_validation() -> None:
    """``decode_segments`` builds ``Segment`` values by setting their slots (issue 5); that is only the same as
    calling the class while it has no ``__post_init__``."""
    assert not hasattr(Segment, "__post_init__"), "Segment validates now: make wire_values.decode_segments call it"


@settings(max_examples=300, deadline=None)
@given(_segment_lists, st.data())
def test_segment_rows_round_trip_and_any_corrupt_byte_is_a_request_error(
    segments: tuple[Segment, ...], data: st.DataObject
) -> None:
    """Issue 5: plan segments travel as packed rows; what decodes is exactly what was sent, and a flipped byte is
    either still a valid plan or an error reply, never another exception."""
    cursor, valid = 0, True
    for segment in segments:
        valid &= cursor <= segment.start
        cursor = segment.end
    num_query_tokens = max(cursor, 1)
    plan = LookupPlan(plan_id=1, session_id=None, num_query_tokens=num_query_tokens, segments=segments)
    wire = encode_plan(plan, None)
    if valid:
        assert plan_from_wire(Fields(dict(wire), "plan")).segments == segments
    rows = bytearray(encode_segments(segments))
    if rows:
        index = data.draw(st.integers(0, len(rows) - 1))
        rows[index] ^= data.draw(st.integers(1, 255))
    cut = data.draw(st.integers(0, len(rows)))
    for corrupt in (bytes(rows), bytes(rows[:cut])):
        try:
            decoded = plan_from_wire(Fields(wire | {"segments": corrupt}, "plan"))
        except RequestError as exc:
            assert exc.code in (ErrorCode.MALFORMED, ErrorCode.INVALID_ARGUMENT)
            continue
        assert all(0 <= s.start < s.end <= num_query_tokens for s in decoded.segments)
        assert all(a.end <= b.start for a, b in zip(decoded.segments, decoded.segments[1:], strict=False))


def a_hello(layout: KVLayout) -> ServerHello:
    return ServerHello(
        client_id="c",
        server_version="1",
        layout=layout,
        chunk_size=256,
        tiers=(TierCapacity(tier=TierName.CPU, capacity_bytes=5),),
        features=ServerFeatures(blend=True, segmented_prefix=False, dedup_content=False, shm=True, cuda_ipc=False),
        limits=LIMITS,
        host_id="h",
    )


def test_hello_round_trips(small_layout: KVLayout) -> None:
    hello = a_hello(small_layout)
    assert ServerHello.from_wire(Fields(msgpack.unpackb(msgpack.packb(hello.to_wire())), "hello")) == hello
    content = dataclasses.replace(hello, chunking=Chunking.CONTENT, chunk_separator=(198, 198))
    assert ServerHello.from_wire(Fields(msgpack.unpackb(msgpack.packb(content.to_wire())), "hello")) == content
    older = {name: value for name, value in hello.to_wire().items() if name != "chunking"}
    assert ServerHello.from_wire(Fields(older, "hello")).chunking is Chunking.FIXED, "a server from before the rule"
    slicing = dataclasses.replace(hello, partial_segments=True)
    assert ServerHello.from_wire(Fields(msgpack.unpackb(msgpack.packb(slicing.to_wire())), "hello")) == slicing
    older = {name: value for name, value in slicing.to_wire().items() if name != "partial_segments"}
    assert not ServerHello.from_wire(Fields(older, "hello")).partial_segments, "a server from before slices"
    wire = hello.to_wire()
    newer = wire | {"a_later_field": [1], "features": wire["features"] | {"later": True},  # type: ignore[operator]
                    "limits": wire["limits"] | {"later_limit": 3}}  # type: ignore[operator]  # fmt: skip
    assert ServerHello.from_wire(Fields(newer, "hello")) == hello, "a newer server's hello: what it adds is ignored"
    with pytest.raises(RequestError, match="not one of fixed, content"):
        ServerHello.from_wire(Fields({**hello.to_wire(), "chunking": "rolling"}, "hello"))


def test_a_hello_names_the_lent_arena_only_when_there_is_one(small_layout: KVLayout) -> None:
    hello = a_hello(small_layout)
    assert "lent_arena" not in hello.to_wire(), "a client from before lending reads nothing new"
    lending = dataclasses.replace(hello, lent_arena=LentArena(name="kvstore-arena-7-00", nbytes=4096, pid=7, fd=12))
    assert ServerHello.from_wire(Fields(msgpack.unpackb(msgpack.packb(lending.to_wire())), "hello")) == lending


@settings(max_examples=100, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=0, max_size=8),
    start_fraction=st.floats(0, 1),
    lent=st.booleans(),
)
def test_loans_round_trip_and_bad_offsets_are_request_errors(lengths: list[int], start_fraction: float, lent: bool):
    segments, at = [], 0
    for index, length in enumerate(lengths):
        key = PrefixKey(bytes([index]) * 16)
        segments.append(Segment(start=at, num_tokens=length, key=key, source_start=at, exact=True, tier=TierName.CPU))
        at += length
    start = int(start_fraction * (segments[0].end - 1)) if segments else 0
    loan = Loan(
        segments=tuple(segments), offsets=tuple(4096 * i for i in range(len(segments))), num_query_tokens=at + 5,
        start=start, misses=(),
    )  # fmt: skip
    wire = msgpack.unpackb(msgpack.packb(encode_loan(loan if lent else None)))
    assert loan_from_wire(Fields(wire, "lend"), start) == (loan if lent else None)
    if lent and segments:
        bad = wire | {"offsets": wire["offsets"][:-1]}
        with pytest.raises(RequestError, match="one byte offset per segment"):
            loan_from_wire(Fields(bad, "lend"), start)
        with pytest.raises(RequestError, match="ends by its start"):
            loan_from_wire(Fields(wire, "lend"), segments[-1].end)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=3))
def test_random_frames_only_ever_raise_request_errors(parts: list[bytes]) -> None:
    try:
        request = decode_request(frames(*parts), LIMITS)
    except RequestError as exc:
        assert exc.code in ErrorCode
        return
    assert request.op in Op  # a random frame that happens to be a valid header is fine too
