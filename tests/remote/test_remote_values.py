"""The remote tier's pure parts: URLs, key names, chunk values and directory records (no server needed)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import ConfigError
from kvstore.keys import PrefixKey, as_token_array, chained_key
from kvstore.layout import KVLayout
from kvstore.remote_address import check_namespace, parse_remote_url
from kvstore.tiers.base import ChunkRecord
from kvstore.tiers.frames.codec import FrameCodec, FrameStatus
from kvstore.tiers.remote.directory import DirectoryRun, decode_run, encode_run
from kvstore.tiers.remote.names import RemoteNames
from kvstore.tiers.remote.remote_value import decode_remote_value, decode_remote_value_into, encode_remote_value

LAYOUT = KVLayout(model_id="remote-test", num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16")
LAYOUT_B = KVLayout(model_id="remote-test-b", num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16")
KEYS = st.binary(min_size=16, max_size=16).map(PrefixKey)
PARENTS = KEYS.filter(any)  # all zeros is how a record says "no parent" (a real key is never that)


# -- URLs -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "host", "port", "tls", "db"),
    [
        ("valkey://cache", "cache", 6379, False, 0),
        ("redis://10.0.0.5:7000/2", "10.0.0.5", 7000, False, 2),
        ("valkeys://cache.internal:6380", "cache.internal", 6380, True, 0),
        ("rediss://[::1]:6390", "::1", 6390, True, 0),
    ],
)
def test_urls_parse_to_host_port_tls_and_database(url: str, host: str, port: int, tls: bool, db: int) -> None:
    address = parse_remote_url(url)
    assert (address.host, address.port, address.tls, address.db) == (host, port, tls, db)
    assert address.client_url().startswith("rediss://" if tls else "redis://")


def test_credentials_reach_the_client_but_never_the_description() -> None:
    address = parse_remote_url("valkey://app:s%40cret@cache:6379?ssl_ca_certs=/etc/ca.pem")
    assert (address.username, address.password) == ("app", "s@cret")
    assert "s@cret" not in address.describe() and "cret" not in repr(address)
    assert address.client_url() == "redis://app:s%40cret@cache:6379/0?ssl_ca_certs=/etc/ca.pem"
    assert parse_remote_url("valkey://:old@cache", password="new").password == "new"


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("http://cache:6379", "scheme"),
        ("valkey://", "no host"),
        ("valkey://cache:notaport", "valkey://HOST:6379"),
        ("valkey://cache:6379/zero", "database number"),
        ("valkey://:hunter2@cache:99999", "***"),
    ],
)
def test_bad_urls_are_one_line_errors_without_the_password(url: str, named: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_remote_url(url)
    message = str(caught.value)
    assert named in message and "\n" not in message and "hunter2" not in message


def test_namespaces_exclude_what_would_move_the_hash_tag() -> None:
    assert check_namespace("kvstore-prod.eu_1") == "kvstore-prod.eu_1"
    for bad in ("", "a{b}", "a b", "x" * 65):
        with pytest.raises(ConfigError):
            check_namespace(bad)


# -- key names --------------------------------------------------------------------------------------------------------


@given(key=KEYS)
def test_a_chunks_name_carries_its_key_as_the_hash_tag(key: PrefixKey) -> None:
    names = RemoteNames.for_layout("ns", LAYOUT, 256)
    name = names.chunk(key).decode()
    assert name.startswith(f"ns:kv:{names.layout_tag}:") and name.endswith("{" + key.hex() + "}")
    assert 0 <= names.shard_of(key) < names.num_directory_shards


def test_layouts_and_chunk_sizes_get_their_own_names() -> None:
    other_layout = KVLayout(model_id="other", num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16")
    tags = {
        RemoteNames.for_layout("ns", LAYOUT, 256).layout_tag,
        RemoteNames.for_layout("ns", LAYOUT, 128).layout_tag,
        RemoteNames.for_layout("ns", other_layout, 256).layout_tag,
    }
    assert len(tags) == 3
    shards = RemoteNames.for_layout("ns", LAYOUT, 256).directory_shards()
    assert len(set(shards)) == 16 and all(b"{d" in shard for shard in shards)


# -- chunk values ---------------------------------------------------------------------------------------------------

CODEC = FrameCodec(2)


NAMESPACE = LAYOUT.namespace


def _chunk(parent: PrefixKey, num_tokens: int, seed: int) -> tuple[ChunkRecord, np.ndarray]:
    """A chunk after ``parent`` (or first in its sequence, for odd seeds): its key chains from them, as stored."""
    rng = np.random.default_rng(seed)
    tokens = as_token_array(rng.integers(0, 50_000, num_tokens))
    parent_key = None if seed % 2 else parent
    record = ChunkRecord(
        key=chained_key(parent_key or NAMESPACE, tokens),
        source_start=256 * (seed % 7),
        tokens=tokens,
        parent_key=parent_key,
    )
    data = rng.integers(0, 256, LAYOUT.chunk_bytes(num_tokens), dtype=np.uint8)
    data[1::2] = rng.integers(60, 64, data[1::2].shape[0], dtype=np.uint8)  # bf16-like high bytes: compressible
    return record, data


@settings(max_examples=40, deadline=None)
@given(key=PARENTS, num_tokens=st.integers(1, 64), seed=st.integers(0, 2**16), frame_bytes=st.sampled_from([256, 4096]))
def test_values_round_trip_bit_identical(key: PrefixKey, num_tokens: int, seed: int, frame_bytes: int) -> None:
    record, data = _chunk(key, num_tokens, seed)
    value = encode_remote_value(record, data, CODEC, frame_bytes, now_ns=1)
    chunk = decode_remote_value(record.key, value, NAMESPACE)
    assert chunk is not None
    assert chunk.record.source_start == record.source_start and chunk.record.parent_key == record.parent_key
    assert np.array_equal(chunk.record.tokens, record.tokens) and chunk.stored_bytes == len(value)
    out = np.empty(chunk.raw_bytes, dtype=np.uint8)
    assert decode_remote_value_into(chunk, CODEC, out) is FrameStatus.OK
    assert np.array_equal(out, data)


@settings(max_examples=100, deadline=None)
@given(key=PARENTS, seed=st.integers(0, 2**16), position=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_any_flipped_bit_is_a_miss_never_wrong_bytes(key: PrefixKey, seed: int, position: float, bit: int) -> None:
    record, data = _chunk(key, 24, seed)
    value = bytearray(encode_remote_value(record, data, CODEC, 1024, now_ns=1))
    value[int(position * len(value))] ^= 1 << bit
    chunk = decode_remote_value(record.key, bytes(value), NAMESPACE)
    if chunk is None:
        return
    out = np.empty(chunk.raw_bytes, dtype=np.uint8)
    assert decode_remote_value_into(chunk, CODEC, out) is not FrameStatus.OK  # every byte is covered by a check


@settings(deadline=None)  # decodes in about a millisecond, but a loaded CI host once took 264 ms over one example
@given(key=PARENTS, cut=st.integers(0, 400))
def test_truncated_foreign_and_misnamed_values_are_misses(key: PrefixKey, cut: int) -> None:
    record, data = _chunk(key, 16, 3)
    value = encode_remote_value(record, data, CODEC, 512, now_ns=1)
    assert decode_remote_value(record.key, value[: min(cut, len(value) - 1)], NAMESPACE) is None
    assert decode_remote_value(record.key, None, NAMESPACE) is None
    assert decode_remote_value(record.key, b"some other application's value", NAMESPACE) is None
    other = PrefixKey(bytes(b ^ 0xFF for b in record.key))
    assert decode_remote_value(other, value, NAMESPACE) is None
    assert decode_remote_value(record.key, value, LAYOUT_B.namespace) is None, "another layout's chain"


@settings(max_examples=50, deadline=None)
@given(parent=PARENTS, seed=st.integers(0, 2**16), num_tokens=st.integers(1, 32))
def test_a_value_whose_header_names_another_chunk_is_refused(parent: PrefixKey, seed: int, num_tokens: int) -> None:
    """Another chunk's value under this chunk's name with the header's key rewritten to match: the header is not
    checksummed, but the record's parent key and tokens must chain to the key asked for."""
    asked, _ = _chunk(parent, num_tokens, seed)
    other, data = _chunk(parent, num_tokens, seed + 2)  # same length and shape: its frames would decode cleanly
    value = bytearray(encode_remote_value(other, data, CODEC, 512, now_ns=1))
    value[16:32] = asked.key
    assert decode_remote_value(asked.key, bytes(value), NAMESPACE) is None


# -- directory records ----------------------------------------------------------------------------------------------


@st.composite
def runs(draw: st.DrawFn) -> DirectoryRun:
    count = draw(st.integers(1, 12))
    keys = tuple(draw(st.lists(KEYS, min_size=count, max_size=count)))
    with_contents = draw(st.booleans())
    values = st.integers(0, 2**64 - 1)
    return DirectoryRun(
        keys=keys,
        source_start=draw(st.integers(0, 2**40)),
        fingerprint_bits=64 if with_contents else 0,
        fingerprints=np.array(draw(st.lists(values, min_size=count, max_size=count)) if with_contents else [],
                              dtype=np.uint64),
        verifications=np.array(draw(st.lists(values, min_size=count, max_size=count)) if with_contents else [],
                               dtype=np.uint64),
        lengths=np.array(draw(st.lists(st.integers(1, 256), min_size=count, max_size=count)) if with_contents else [],
                         dtype=np.uint16),
    )  # fmt: skip


@given(run=runs(), host_id=st.integers(0, 2**64 - 1))
def test_directory_records_round_trip(run: DirectoryRun, host_id: int) -> None:
    decoded = decode_run(encode_run(run, host_id))
    assert decoded is not None
    publisher, back = decoded
    assert publisher == host_id and back.keys == run.keys and back.source_start == run.source_start
    assert back.fingerprint_bits == run.fingerprint_bits
    for name in ("fingerprints", "verifications", "lengths"):
        assert np.array_equal(getattr(back, name), getattr(run, name))


@given(run=runs(), position=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_a_damaged_directory_record_is_refused(run: DirectoryRun, position: float, bit: int) -> None:
    record = bytearray(encode_run(run, 7))
    record[int(position * len(record))] ^= 1 << bit
    assert decode_run(bytes(record)) is None
    assert decode_run(bytes(record[:-1])) is None
