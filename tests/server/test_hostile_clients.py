"""Clients that attack the server through their own shared-memory segments.

A server maps its clients' segments; if one of them shrank under the mapping, the server's next access would be a
SIGBUS that kills it for everyone. Each case here is a local client speaking the wire protocol directly (as a
hostile program would, not through ``kvstore.Client``) against a real ``kvstore serve`` process: every attempt
gets an error reply, and afterwards the server is alive and serves bit-identical KV to an honest client.
"""

from __future__ import annotations

import ctypes
import fcntl
import itertools
import mmap
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import zmq

from kvstore import Client
from kvstore.wire.protocol import PROTOCOL_VERSION, Reply, decode_reply
from kvstore.wire.shm import host_id
from tests.factories import make_kv, make_tokens
from tests.server.conftest import CHUNK_SIZE, SERVER_LAYOUT, ServerProcess

CHUNK_BYTES = SERVER_LAYOUT.chunk_bytes(CHUNK_SIZE)


def _token_bytes(tokens: object) -> bytes:
    return np.asarray(tokens, dtype=np.int64).astype("<u4").tobytes()


class RawClient:
    """The wire protocol over a DEALER socket, with the real pid and host id of this process (so shared memory is
    offered), and nothing of ``kvstore.Client``'s care."""

    def __init__(self, url: str) -> None:
        self._ids = itertools.count(1)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(url)
        args = {"layout": SERVER_LAYOUT.to_json(), "client_name": "hostile", "pid": os.getpid(), "host_id": host_id()}
        hello = self.request("hello", args, client=None)
        assert hello.ok and hello.result is not None
        self.client_id = hello.result.required_str("client_id", 64)

    def request(self, op: str, args: dict[str, object], client: object = "self", payload: bytes | None = None) -> Reply:
        header = {"v": PROTOCOL_VERSION, "id": next(self._ids), "op": op, "args": args}
        header["client"] = self.client_id if client == "self" else client
        frames = [msgpack.packb(header, use_bin_type=True)] + ([payload] if payload is not None else [])
        self._socket.send_multipart(frames)
        assert self._socket.poll(30_000), f"no reply to {op}: the server hangs or died"
        return decode_reply([frame.buffer for frame in self._socket.recv_multipart(copy=False)])

    def attach(self, name: str, nbytes: int, fd: int) -> Reply:
        return self.request("attach", {"name": name, "nbytes": nbytes, "fd": fd})

    def store_from(self, segment_id: int, tokens: object) -> Reply:
        bulk = {"kind": "shm", "segment_id": segment_id, "offset": 0, "nbytes": CHUNK_BYTES}
        token_bytes = _token_bytes(tokens)
        return self.request("store", {"tokens": token_bytes, "bulk": bulk, "durable": False})

    def retrieve_into(self, segment_id: int, tokens: object) -> Reply:
        token_bytes = _token_bytes(tokens)
        plan = self.request("lookup", {"tokens": token_bytes, "session_id": None, "blend": None})
        assert plan.ok and plan.result is not None, plan.error_message
        plan_id = plan.result.required_int("plan_id", 1, 2**63 - 1)
        bulk = {"kind": "shm", "segment_id": segment_id, "offset": 0, "nbytes": CHUNK_BYTES}
        return self.request("retrieve", {"plan_id": plan_id, "bulk": bulk})

    def close(self) -> None:
        self.request("goodbye", {})
        self._socket.close()
        self._context.term()


@pytest.fixture
def raw(server: ServerProcess) -> Iterator[RawClient]:
    client = RawClient(server.url)
    yield client
    client.close()


def _segment_name() -> str:
    return f"kvstore-{os.getpid()}-{secrets.token_hex(8)}"


def _memfd(name: str, nbytes: int, seals: int) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _assert_refused(reply: Reply, *words: str) -> None:
    assert not reply.ok, "the server accepted a hostile segment"
    assert reply.error_code == "invalid_argument", reply.error_message
    assert reply.error_message is not None and "\n" not in reply.error_message
    assert all(word in reply.error_message for word in words), reply.error_message


def _assert_serving(server: ServerProcess, seed: int) -> None:
    assert server.process.poll() is None, f"the server died (exit {server.process.returncode})"
    tokens, kv = make_tokens(3 * CHUNK_SIZE, seed=seed), make_kv(SERVER_LAYOUT, 3 * CHUNK_SIZE, seed=seed)
    with Client(server.url, SERVER_LAYOUT) as honest:
        honest.store(tokens, kv)
        assert torch.equal(honest.retrieve(honest.lookup(tokens)).kv, kv)
    assert "Traceback" not in server.stderr()


def test_an_unsealed_segment_truncated_after_attach_is_refused_and_the_server_lives(
    server: ServerProcess, raw: RawClient
) -> None:
    """The issue's attack: attach a segment, shrink it to 0 bytes, send a store that points into it."""
    name = _segment_name()
    fd = _memfd(name, CHUNK_BYTES, seals=0)
    try:
        _assert_refused(raw.attach(name, CHUNK_BYTES, fd), "not sealed")
        os.ftruncate(fd, 0)
        reply = raw.store_from(1, make_tokens(CHUNK_SIZE, seed=1))
        assert not reply.ok and reply.error_code == "unknown_segment", reply.error_message
    finally:
        os.close(fd)
    _assert_serving(server, seed=11)


def test_a_sealed_segment_cannot_shrink_and_works_for_store_and_retrieve(server: ServerProcess, raw: RawClient) -> None:
    name = _segment_name()
    fd = _memfd(name, CHUNK_BYTES, seals=fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    try:
        attached = raw.attach(name, CHUNK_BYTES, fd)
        assert attached.ok and attached.result is not None, attached.error_message
        segment_id = attached.result.required_int("segment_id", 1, 2**31 - 1)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)  # the kernel refuses: this is what keeps the server's mapping whole
        tokens, kv = make_tokens(CHUNK_SIZE, seed=2), make_kv(SERVER_LAYOUT, CHUNK_SIZE, seed=2)
        os.pwrite(fd, kv.view(torch.uint8).numpy().tobytes(), 0)
        assert raw.store_from(segment_id, tokens).ok
        os.pwrite(fd, bytes(CHUNK_BYTES), 0)
        retrieved = raw.retrieve_into(segment_id, tokens)
        assert retrieved.ok, retrieved.error_message
        assert os.pread(fd, CHUNK_BYTES, 0) == kv.view(torch.uint8).numpy().tobytes()
    finally:
        os.close(fd)
    _assert_serving(server, seed=12)


HUGE_PAGE_BYTES = 2 << 20
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def _meminfo_number(field: str) -> int:
    """A number of ``/proc/meminfo`` (``HugePages_Free``: pages; ``Hugepagesize``: kB)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == field:
            return int(value.split()[0])
    raise AssertionError(f"/proc/meminfo has no {field}")


@pytest.fixture
def hugepage_pool() -> Iterator[int]:
    """Two more 2 MiB huge pages for the test (``vm.nr_hugepages``); yields how many are free, and puts the host's
    setting back after. Skips only when the host cannot give them (not root, other page size, no memory)."""
    if _meminfo_number("Hugepagesize") * 1024 != HUGE_PAGE_BYTES:
        pytest.skip(f"huge pages here are {_meminfo_number('Hugepagesize')} kB; the attack is written for 2 MiB")
    setting = Path("/proc/sys/vm/nr_hugepages")
    before = setting.read_text()
    try:
        setting.write_text(str(int(before) + 2))
    except OSError as exc:
        pytest.skip(f"cannot reserve huge pages here ({exc.strerror}): the attack needs a hugepage pool (root)")
    try:
        num_free = _meminfo_number("HugePages_Free")
        if num_free < 2:  # the kernel grants what it can find: touching a page it did not grant is a SIGBUS here
            pytest.skip(f"the host has no huge pages to give: asked vm.nr_hugepages={int(before) + 2}, {num_free} free")
        yield num_free
    finally:
        setting.write_text(before)


def _huge_memfd(name: str, nbytes: int) -> tuple[int, mmap.mmap]:
    """A hugetlb memfd of ``nbytes``, every page touched (allocated from the pool), and its mapping."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | os.MFD_HUGETLB)
    os.ftruncate(fd, nbytes)
    mapped = mmap.mmap(fd, nbytes)
    for offset in range(0, nbytes, HUGE_PAGE_BYTES):
        mapped[offset] = 1
    return fd, mapped


def test_a_hugetlb_memfd_is_refused_and_the_server_lives(
    server: ServerProcess, raw: RawClient, hugepage_pool: int
) -> None:
    """The issue's attack: a sealed hugetlb memfd passes the name, size and seal checks; after the attach its owner
    punches a hole in it and takes every free huge page, so the server's next touch of the hole finds no page and
    dies with SIGBUS."""
    name = _segment_name()
    fd, mapped = _huge_memfd(name, HUGE_PAGE_BYTES)
    hog_fd = -1
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        reply = raw.attach(name, HUGE_PAGE_BYTES, fd)
        segment_id = reply.result.required_int("segment_id", 1, 2**31 - 1) if reply.ok and reply.result else 1
        libc = ctypes.CDLL(None, use_errno=True)
        punch = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
        assert libc.fallocate(fd, punch, ctypes.c_long(0), ctypes.c_long(HUGE_PAGE_BYTES)) == 0
        hog_fd, hog = _huge_memfd(_segment_name(), hugepage_pool * HUGE_PAGE_BYTES)  # the whole pool
        stored = raw.store_from(segment_id, make_tokens(CHUNK_SIZE, seed=3))
        hog.close()
        _assert_refused(reply, "not a plain memfd", "hugetlb")
        assert not stored.ok and stored.error_code == "unknown_segment", stored.error_message
    finally:
        mapped.close()
        os.close(fd)
        if hog_fd >= 0:
            os.close(hog_fd)
    _assert_serving(server, seed=13)


@pytest.mark.parametrize("attack", ["dev_shm_file", "other_descriptor", "size_lie", "grow_only_seal", "other_pid"])
def test_descriptors_that_could_change_under_the_server_are_refused(
    server: ServerProcess, raw: RawClient, tmp_path: Path, attack: str
) -> None:
    name = _segment_name()
    if attack == "dev_shm_file":  # the old scheme: a named tmpfs file anyone of this user can truncate
        path = Path("/dev/shm") / name
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, CHUNK_BYTES)
        path.unlink()
        reply, words = raw.attach(name, CHUNK_BYTES, fd), ("descriptor",)
    elif attack == "other_descriptor":  # a sealed memfd exists, but the fd sent is some other file
        fd = _memfd(name, CHUNK_BYTES, seals=fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        other = os.open(tmp_path / "plain", os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(other, CHUNK_BYTES)
        reply, words = raw.attach(name, CHUNK_BYTES, other), ("descriptor",)
        os.close(other)
    elif attack == "size_lie":
        fd = _memfd(name, CHUNK_BYTES, seals=fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        reply, words = raw.attach(name, 2 * CHUNK_BYTES, fd), ("bytes",)
    elif attack == "grow_only_seal":
        fd = _memfd(name, CHUNK_BYTES, seals=fcntl.F_SEAL_GROW)
        reply, words = raw.attach(name, CHUNK_BYTES, fd), ("not sealed",)
    else:  # a name that claims another process (the server's own)
        fd = _memfd(name, CHUNK_BYTES, seals=fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        foreign = f"kvstore-{server.pid}-{secrets.token_hex(8)}"
        reply, words = raw.attach(foreign, CHUNK_BYTES, fd), ("belongs to pid",)
    try:
        _assert_refused(reply, *words)
    finally:
        os.close(fd)
    _assert_serving(server, seed=13)


def test_a_cuda_handle_whose_view_overruns_its_storage_is_refused_before_any_device_access(
    server: ServerProcess, raw: RawClient
) -> None:
    """Checked while parsing, so a server without CUDA refuses it the same way as one with."""
    shape = list(SERVER_LAYOUT.chunk_shape(CHUNK_SIZE))
    contiguous = [int(stride) for stride in torch.empty(shape).stride()]
    handle = {
        "device": 0, "handle": bytes(64), "storage_size_bytes": CHUNK_BYTES - 2, "storage_offset_bytes": 0,
        "ref_counter_handle": b"", "ref_counter_offset": 0, "event_handle": b"", "event_sync_required": False,
        "tensor_offset": 0, "shape": shape, "stride": contiguous, "dtype": SERVER_LAYOUT.dtype.value,
    }  # fmt: skip
    token_bytes = _token_bytes(make_tokens(CHUNK_SIZE, seed=3))
    args = {"tokens": token_bytes, "bulk": {"kind": "cuda_ipc", "handle": handle}, "durable": False}
    reply = raw.request("store", args)
    _assert_refused(reply, "past its storage")
    _assert_serving(server, seed=14)
