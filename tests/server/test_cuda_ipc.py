"""CUDA tensors between a client and a server on one GPU host go by IPC handle: the server reads the client's
tensor on a store and writes into it on a retrieve, device to device (needs CUDA: run on the H200)."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
import torch

from kvstore import Client
from kvstore.server.cuda_ipc import export_cuda_tensor
from tests.factories import make_kv, make_tokens
from tests.server.conftest import SERVER_LAYOUT, running_server

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (shared-memory twins run everywhere)"),
]


def test_cuda_tensors_travel_by_ipc_handle(tmp_path: Path) -> None:
    tokens = make_tokens(96, seed=7)
    kv = make_kv(SERVER_LAYOUT, 96, seed=7).cuda()
    with running_server(tmp_path / "data", "--tiers", "gpu,cpu,disk", "--gpu-size-gb", "0.05") as server:
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
