"""The check both one-launch test files share (the interpreted kernel on the CPU, the compiled one on CUDA)."""

from __future__ import annotations

import torch

from kvstore.connectors.paged import PagedChunk, PagedLayers


def assert_one_launch_gathers_as_layer_by_layer(layers: PagedLayers, ids: torch.Tensor, gathered: torch.Tensor) -> None:
    """``gather_all`` into ``gathered`` (NaN-poisoned by the caller) is one launch and leaves exactly what per-layer
    gathers leave in a NaN-poisoned twin, the slots past the chunk's tokens untouched."""
    gather = PagedChunk(layers, ids, gathered)
    assert gather.one_launch
    gather.gather_all()
    expected = torch.full_like(gathered, float("nan"))
    layerwise = PagedChunk(layers, ids, expected)
    for layer in range(len(layers)):
        layerwise.gather(layer)
    assert torch.equal(gathered, expected)
