"""CUDA tensors between a client and a server on one GPU host go by IPC handle: the server reads the client's
tensor on a store and writes into it on a retrieve, device to device (needs CUDA: run on the H200)."""

from __future__ import annotations

import dataclasses
import urllib.request
from pathlib import Path

import pytest
import torch

from kvstore import Client
from kvstore.keys import as_token_array
from kvstore.wire.cuda_ipc import export_cuda_tensor
from kvstore.wire.messages import CudaIpcBulk, StoreArgs
from kvstore.wire.protocol import Op
from tests.factories import make_kv, make_tokens
from tests.server.conftest import SERVER_LAYOUT, running_server

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (shared-memory twins run everywhere)"),
]


def test_cuda_tensors_travel_by_ipc_handle(tmp_path: Path) -> None:
    tokens = make_tokens(96, seed=7)
    kv = make_kv(SERVER_LAYOUT, 96, seed=7).cuda()
    with running_server(tmp_path / "data", "--tiers", "gpu,cpu,disk", "--gpu-size", "50MiB") as server:
        with Client(server.url, SERVER_LAYOUT) as client:
            assert client.server.features.cuda_ipc
            client.store(tokens, kv)
            out = torch.zeros((*kv.shape[:2], 128, *kv.shape[3:]), dtype=kv.dtype, device="cuda")
            result = client.retrieve(client.lookup(tokens), out)
            assert result.kv.data_ptr() == out.data_ptr(), "written in place by the server"
            assert torch.equal(out[:, :, :96], kv)
            assert torch.equal(client.retrieve(client.lookup(tokens)).kv, kv.cpu()), "cpu callers unaffected"
        with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
            text = response.read().decode()
        assert 'kvstore_bulk_bytes_total{direction="stored",transport="cuda_ipc"}' in text
        assert 'kvstore_bulk_bytes_total{direction="retrieved",transport="cuda_ipc"}' in text


def test_exported_handles_describe_the_tensor() -> None:
    tensor = make_kv(SERVER_LAYOUT, 16).cuda()[:, :, 4:12]
    handle = export_cuda_tensor(tensor)
    assert handle.shape == tuple(tensor.shape) and handle.stride == tuple(tensor.stride())
    assert handle.tensor_offset == tensor.storage_offset() and handle.dtype.value == "bfloat16"


def test_a_handle_claiming_more_storage_than_its_allocation_is_refused(tmp_path: Path) -> None:
    """A lie the view check cannot see (the view fits the claimed storage): the driver's allocation range can.
    Touching past the allocation would poison the server's CUDA context for every later request."""
    tokens = make_tokens(32, seed=9)
    kv = make_kv(SERVER_LAYOUT, 32, seed=9)
    with running_server(tmp_path / "data", "--tiers", "gpu,cpu,disk", "--gpu-size", "50MiB") as server:
        with Client(server.url, SERVER_LAYOUT) as client:
            small = torch.empty(2**20, dtype=torch.bfloat16, device="cuda")  # 2 MiB in an allocation of its own
            handle = export_cuda_tensor(small)
            lie = dataclasses.replace(
                handle,
                storage_size_bytes=handle.storage_size_bytes + 64 * 2**20,
                shape=tuple(SERVER_LAYOUT.chunk_shape(32)),
                stride=tuple(torch.empty(SERVER_LAYOUT.chunk_shape(32)).stride()),
                tensor_offset=0,
                dtype=SERVER_LAYOUT.dtype,
            )
            lie = dataclasses.replace(lie, tensor_offset=(lie.storage_size_bytes - SERVER_LAYOUT.chunk_bytes(32)) // 2)
            args = StoreArgs(tokens=as_token_array(tokens), bulk=CudaIpcBulk(handle=lie), durable=False)
            reply = client._call(Op.STORE, lambda: (args.to_wire(), None))
            assert not reply.ok and reply.error_code == "invalid_argument", reply.error_message
            assert "allocation" in (reply.error_message or "")
            client.store(tokens, kv.cuda())
            assert torch.equal(client.retrieve(client.lookup(tokens)).kv, kv), "the server's CUDA context is fine"
        assert "Traceback" not in server.stderr()
