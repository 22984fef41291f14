"""Retrieves that come up short, through every way the KV can travel: what a retrieve reports served is what was
stored, bit for bit, and nothing else is reported served.

A serve comes up short when a planned chunk cannot be loaded: its remote value is gone (Valkey evicted it) or the
remote timed out, its disk frame fails its checksum (damaged before or after the lookup). The retrieve then serves
fewer tokens than its plan, and every transport must still put each served segment's KV at its place: the inline
reply, the client's scratch segment (laid out by the server for the plan's length), a buffer region the server
writes in place, a caller's tensor the scratch is copied into, and the vLLM connector's kept load buffers (reused
across loads, so stale KV of an earlier load lies in them). A chunk evicted between lookup and retrieve is the
counter-case: its pinned copy is served whole.

The servers are real ``kvstore serve`` processes (disk tier only, so every chunk is read from LMDB; and a fleet of
two on a real valkey-server, the reader with no memory tier, so every remote chunk is read at retrieve time).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import Client
from kvstore.bench.remote_fleet import lookup_when_known
from kvstore.bench.valkey_server import ValkeyServer
from kvstore.connectors.load_buffers import LoadBuffers
from kvstore.plan import LookupPlan, Segment
from kvstore.tiers.base import TierName
from tests.factories import flip_frame_bit, make_kv, make_tokens
from tests.server.conftest import CHUNK_SIZE, SERVER_LAYOUT, ServerProcess, running_server

pytestmark = pytest.mark.slow

TRANSPORTS = ("inline", "shm_scratch", "shm_region", "caller_out", "connector_buffer")
DISK_SHORTFALLS = ("frame_damaged_before_lookup", "frame_damaged_after_lookup", "evicted_after_lookup")
REMOTE_SHORTFALLS = ("remote_value_gone", "remote_timeout")
UNWRITTEN = 7.0
"""What a caller's buffer holds before a retrieve: KV drawn from randn is never exactly this everywhere."""

_seeds = itertools.count(1000)


@dataclass
class Hosts:
    """The module's servers: disk-only hosts with and without segmented prefix, and a fleet on one Valkey."""

    disk_cut: ServerProcess
    disk_segmented: ServerProcess
    fleet_writer: ServerProcess
    fleet_reader: ServerProcess
    valkey: ValkeyServer


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    root = tmp_path_factory.mktemp("short-serves")
    with ValkeyServer(root / "valkey") as valkey:
        disk = ("--tiers", "disk", "--cpu-size", "0", "--enable-blend")
        remote = ("--remote-url", valkey.url, "--enable-blend", "--enable-segmented-prefix")
        remote += ("--remote-timeout-ms", "200")
        starts = [
            (root / "disk-cut", disk),
            (root / "disk-segmented", (*disk, "--enable-segmented-prefix")),
            (root / "fleet-writer", ("--tiers", "cpu,disk,remote", *remote)),
            (root / "fleet-reader", ("--tiers", "disk,remote", "--cpu-size", "0", *remote)),
        ]
        contexts = [running_server(data_dir, *extra) for data_dir, extra in starts]
        with ThreadPoolExecutor(len(contexts)) as pool:  # each start takes seconds: start them together
            servers = list(pool.map(lambda context: context.__enter__(), contexts))
        try:
            yield Hosts(*servers, valkey=valkey)
        finally:
            for context in reversed(contexts):
                context.__exit__(None, None, None)


@pytest.fixture(scope="module")
def clients(hosts: Hosts) -> Iterator[dict[tuple[str, str], Client]]:
    """One client per (server, transport kind), kept across examples: scratch segments and buffers get reused."""
    made: dict[tuple[str, str], Client] = {}
    for name in ("disk_cut", "disk_segmented", "fleet_writer", "fleet_reader"):
        url = getattr(hosts, name).url
        made[name, "inline"] = Client(url, SERVER_LAYOUT, transport="inline")
        made[name, "shm"] = Client(url, SERVER_LAYOUT, transport="shm")
    yield made
    for client in made.values():
        client.close()


@pytest.fixture(scope="module")
def load_buffers() -> LoadBuffers:
    return LoadBuffers()


@dataclass(frozen=True)
class Document:
    tokens: npt.NDArray[np.int64]
    kv: torch.Tensor


def _document(num_chunks: int, tail: int) -> Document:
    seed = next(_seeds)
    num_tokens = num_chunks * CHUNK_SIZE + tail
    return Document(make_tokens(num_tokens, seed=seed), make_kv(SERVER_LAYOUT, num_tokens, seed=seed))


def _prompt(shape: str, first: Document, second: Document) -> npt.NDArray[np.int64]:
    """``alone``: the first document as stored (exact segments); ``behind``: the second, then the first (exact,
    then moved segments); ``moved``: a few fresh tokens, then the first (moved segments only)."""
    if shape == "alone":
        return first.tokens
    if shape == "behind":
        return np.concatenate([second.tokens, first.tokens])
    return np.concatenate([make_tokens(CHUNK_SIZE // 2 + 3, seed=next(_seeds)), first.tokens])


def _stored_kv(segment: Segment, prompt: npt.NDArray[np.int64], documents: tuple[Document, ...]) -> torch.Tensor:
    """The KV stored for the chunk a segment names: the document whose tokens the segment's source range holds."""
    tokens = prompt[segment.start : segment.end]
    source = slice(segment.source_start, segment.source_start + segment.num_tokens)
    for document in documents:
        if np.array_equal(document.tokens[source], tokens):
            return document.kv[:, :, source]
    raise AssertionError(f"segment {segment} names no stored document's tokens")


def _retrieve(
    transport: str, client: Client, plan: LookupPlan, load_buffers: LoadBuffers, start: int
) -> tuple[list[Segment], torch.Tensor, int]:
    """Retrieve tokens ``[start, end)`` through one transport: the segments reported served, the KV as the caller
    sees it (token ``start + i`` at index ``i``), and up to which token the caller may use it (the connector uses the
    exact prefix only)."""
    if transport in ("inline", "shm_scratch"):
        result = client.retrieve(plan, start=start)
        assert transport == "inline" or result.kv.device.type == "cpu"
        return list(result.segments), result.kv, start + result.kv.shape[2]
    needed = plan.end - start
    if transport == "shm_region":
        out = client.buffer(needed + 5)  # a region longer than the plan, as a caller's buffer may be
        out.fill_(UNWRITTEN)
    elif transport in ("caller_out", "cuda_ipc"):
        device = "cuda" if transport == "cuda_ipc" else "cpu"
        shape, dtype = SERVER_LAYOUT.chunk_shape(needed + 3), SERVER_LAYOUT.dtype.torch_dtype
        out = torch.full(shape, UNWRITTEN, dtype=dtype, device=device)
    else:  # the connector's kept buffers: not refilled, so an earlier load's KV lies past what this one writes
        kept = load_buffers.take(client, needed)
        assert kept is not None, "the server is on this host: the connector gets a shared buffer"
        out = kept
    try:
        result = client.retrieve(plan, out, start=start)
        assert result.kv.numel() == 0 or result.kv.data_ptr() == out.data_ptr(), "the KV lands in the caller's buffer"
        usable = result.num_prefix_tokens if transport == "connector_buffer" else start + result.kv.shape[2]
        return list(result.segments), result.kv.cpu().clone(), usable
    finally:
        if transport == "connector_buffer":
            load_buffers.give_back(out)


def _assert_served_as_stored(
    served: list[Segment],
    kv: torch.Tensor,
    usable: int,
    plan: LookupPlan,
    prompt: npt.NDArray[np.int64],
    documents: tuple[Document, ...],
    start: int,
) -> None:
    planned = list(plan.segments)
    assert all(segment in planned for segment in served), "only planned segments are reported served"
    assert all(segment.end > start for segment in served), "a segment the caller holds already is not served"
    assert served == sorted(served, key=lambda segment: segment.start), "in prompt order"
    end = served[-1].end if served else start
    assert kv.shape[2] >= min(end, usable) - start, f"the KV holds the served tokens: {kv.shape[2]} < {end} - {start}"
    for segment in served:
        if segment.end > usable:
            continue
        first = max(segment.start, start)  # a segment straddling the start is served from there
        stored = _stored_kv(segment, prompt, documents)[:, :, first - segment.start :]
        same = torch.equal(kv[:, :, first - start : segment.end - start], stored)
        assert same, f"segment {segment} is reported served but its KV differs from what was stored"


def _wait_until_remote_available(client: Client, timeout_s: float = 20.0) -> None:
    """Until the server's remote link has closed its outage (a second of successes after Valkey answers again)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        remote = client.stats().remote
        if remote is not None and remote.available:
            return
        time.sleep(0.1)
    raise AssertionError(f"the remote stayed unavailable for {timeout_s:g} s")


def _expected_served(plan: LookupPlan, failed: set[bytes], segmented: bool, start: int) -> list[Segment]:
    """What a disk-only store serves from ``start`` when ``failed`` chunks cannot load: the rest, except that
    without segmented prefix an exact segment after a failed exact one is dropped too (its prefix is gone). A
    segment that ends by ``start`` is the caller's: neither read nor served."""
    served: list[Segment] = []
    cut = False
    for segment in plan.segments:
        if segment.end <= start or (segment.exact and cut):
            continue
        if segment.key in failed:
            cut = cut or (segment.exact and not segmented)
            continue
        served.append(segment)
    return served


DISK_CASES = {
    "shortfall": st.sampled_from(DISK_SHORTFALLS),
    "segmented": st.booleans(),
    "shape": st.sampled_from(("alone", "behind", "moved")),
    "num_chunks": st.integers(2, 6),
    "tail": st.integers(0, CHUNK_SIZE - 1),
    "victims": st.lists(st.integers(0, 7), min_size=1, max_size=2, unique=True),
    "start": st.sampled_from((0, 0, 1, CHUNK_SIZE - 1, CHUNK_SIZE, 2 * CHUNK_SIZE + 5, 10**6)),  # 10**6: the end
}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(transport=st.sampled_from(TRANSPORTS), **DISK_CASES)
def test_disk_shortfalls_serve_only_what_was_stored(
    hosts: Hosts, clients: dict[tuple[str, str], Client], load_buffers: LoadBuffers, transport: str, **case: object
) -> None:
    _check_disk_shortfall(hosts, clients, load_buffers, transport, **case)  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the shared-memory twin runs everywhere)")
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**DISK_CASES)
def test_disk_shortfalls_through_cuda_ipc_serve_only_what_was_stored(
    hosts: Hosts, clients: dict[tuple[str, str], Client], load_buffers: LoadBuffers, **case: object
) -> None:
    assert clients["disk_cut", "shm"].server.features.cuda_ipc
    _check_disk_shortfall(hosts, clients, load_buffers, "cuda_ipc", **case)  # type: ignore[arg-type]


def _check_disk_shortfall(
    hosts: Hosts,
    clients: dict[tuple[str, str], Client],
    load_buffers: LoadBuffers,
    transport: str,
    shortfall: str,
    segmented: bool,
    shape: str,
    num_chunks: int,
    tail: int,
    victims: list[int],
    start: int,
) -> None:
    name = "disk_segmented" if segmented else "disk_cut"
    server = getattr(hosts, name)
    client = clients[name, "inline" if transport == "inline" else "shm"]
    documents = (_document(num_chunks, tail), _document(2, 0))
    for document in documents:
        client.store(document.tokens, document.kv, durable=True)
    prompt = _prompt(shape, *documents)
    if shortfall == "frame_damaged_before_lookup":
        probe = client.lookup(prompt)
        client.release(probe)
        failed = {probe.segments[index % len(probe.segments)].key for index in victims}
        for key in failed:
            flip_frame_bit(server.data_dir, key)
        plan = client.lookup(prompt)
    else:
        plan = client.lookup(prompt)
        assert plan.segments, "the stored documents are planned"
        chosen = {plan.segments[index % len(plan.segments)].key for index in victims}
        if shortfall == "frame_damaged_after_lookup":
            for key in chosen:
                flip_frame_bit(server.data_dir, key)
            failed = chosen
        else:
            assert client.evict(sorted(chosen)) == 0, "a planned chunk is pinned: its copy stays until the retrieve"
            failed = set()
    start = min(start, plan.end)
    served, kv, usable = _retrieve(transport, client, plan, load_buffers, start)
    _assert_served_as_stored(served, kv, usable, plan, prompt, documents, start)
    expected = _expected_served(plan, failed, segmented, start)
    assert served == expected, "exactly the chunks that loaded are reported served"
    assert server.process.poll() is None


REMOTE_CASES = {
    "shortfall": st.sampled_from(REMOTE_SHORTFALLS),
    "shape": st.sampled_from(("alone", "moved")),
    "num_chunks": st.integers(2, 6),
    "victim": st.integers(0, 7),
    "start": st.sampled_from((0, 0, 1, CHUNK_SIZE + 3)),
}


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(transport=st.sampled_from(TRANSPORTS), **REMOTE_CASES)
def test_remote_shortfalls_serve_only_what_was_stored(
    hosts: Hosts, clients: dict[tuple[str, str], Client], load_buffers: LoadBuffers, transport: str, **case: object
) -> None:
    _check_remote_shortfall(hosts, clients, load_buffers, transport, **case)  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the shared-memory twin runs everywhere)")
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**REMOTE_CASES)
def test_remote_shortfalls_through_cuda_ipc_serve_only_what_was_stored(
    hosts: Hosts, clients: dict[tuple[str, str], Client], load_buffers: LoadBuffers, **case: object
) -> None:
    _check_remote_shortfall(hosts, clients, load_buffers, "cuda_ipc", **case)  # type: ignore[arg-type]


def _check_remote_shortfall(
    hosts: Hosts,
    clients: dict[tuple[str, str], Client],
    load_buffers: LoadBuffers,
    transport: str,
    shortfall: str,
    shape: str,
    num_chunks: int,
    victim: int,
    start: int,
) -> None:
    """Another host stored the document; this one has no memory tier, so every chunk is read from Valkey at
    retrieve time. A value gone, or a Valkey that stops answering, leaves gaps; a remote outage that an earlier
    example opened may fail more reads, so only "nothing but stored KV" is exact here."""
    writer = clients["fleet_writer", "shm"]
    reader = clients["fleet_reader", "inline" if transport == "inline" else "shm"]
    for host in (writer, reader):  # an earlier example's hung Valkey left an outage: writes would be dropped
        _wait_until_remote_available(host)
    document = _document(num_chunks, 0)
    writer.store(document.tokens, document.kv)
    writer.flush()
    prompt = _prompt(shape, document, document)
    known = lookup_when_known(reader, prompt, len(document.tokens))
    reader.release(known)
    assert {segment.tier for segment in known.segments} == {TierName.REMOTE}, "the reader holds nothing locally"
    plan = reader.lookup(prompt)
    victim_segment = plan.segments[victim % len(plan.segments)]
    victim_key = victim_segment.key
    start = min(start, victim_segment.end - 1)  # the caller does not hold the victim: it is read
    if shortfall == "remote_value_gone":
        with hosts.valkey.client() as valkey:
            names = list(valkey.scan_iter(match=f"*{{{victim_key.hex()}}}"))
            assert len(names) == 1, f"one value per chunk: {names}"
            valkey.delete(*names)
        served, kv, usable = _retrieve(transport, reader, plan, load_buffers, start)
    else:
        hosts.valkey.pause()
        try:
            served, kv, usable = _retrieve(transport, reader, plan, load_buffers, start)
        finally:
            hosts.valkey.resume()
    _assert_served_as_stored(served, kv, usable, plan, prompt, (document,), start)
    assert victim_key not in {segment.key for segment in served}, "the chunk that could not load is not served"
    assert len(served) < len(plan.segments), "the serve came up short"
    assert hosts.fleet_reader.process.poll() is None
