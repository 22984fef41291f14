"""``Client.retrieve(progress=...)`` against a real ``kvstore serve``: the server moves a plan's KV in one piece, so
the client reports the segments and then every layer, in order, once the KV has landed (what a layerwise blender
waits on works the same over a server as in process)."""

from __future__ import annotations

import pytest
import torch

from kvstore import Client
from kvstore.plan import RetrieveProgress, Segment
from tests.factories import make_kv, make_tokens
from tests.server.conftest import SERVER_LAYOUT, ServerProcess

pytestmark = pytest.mark.slow


class Recorder(RetrieveProgress):
    def __init__(self, out: torch.Tensor, expected: torch.Tensor) -> None:
        self.out, self.expected = out, expected
        self.events: list[object] = []

    def segments_loaded(self, segments: tuple[Segment, ...]) -> None:
        self.events.append(segments)

    def layer_queued(self, layer: int) -> None:
        assert torch.equal(self.out[layer, :, : self.expected.shape[2]], self.expected[layer]), "reported too early"
        self.events.append(layer)


def test_a_client_retrieve_reports_segments_then_every_layer(server: ServerProcess) -> None:
    tokens, kv = make_tokens(64, seed=71), make_kv(SERVER_LAYOUT, 64, seed=71)
    with Client(server.url, SERVER_LAYOUT) as client:
        client.store(tokens, kv)
        out = torch.zeros(SERVER_LAYOUT.chunk_shape(64), dtype=SERVER_LAYOUT.dtype.torch_dtype)
        recorder = Recorder(out, kv)
        result = client.retrieve(client.lookup(tokens), out, progress=recorder)
        assert recorder.events == [result.segments, *range(SERVER_LAYOUT.num_layers)]
        assert torch.equal(out, kv)
