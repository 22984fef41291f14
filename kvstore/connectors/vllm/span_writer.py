"""``PagedSpanWriter``: a blend pass's span, computed outside the connector, written into a request's paged blocks.

The blend engine (``kvstore.blend.vllm``) computes a span's KV on the engine's model but knows nothing of the
engine's block format: the worker hands it this writer (``kvstore.blend.vllm.hook.SpanWriter``), which copies every
layer's tokens ``[local_end, end)`` into the blocks at once (``PagedChunk.scatter_all``). Tokens below ``local_end``
are vLLM's own prefix-cache blocks, possibly shared with other requests: never written.

Runs on vLLM's model-runner thread (inside the pass).
"""

from __future__ import annotations

import torch

from kvstore.connectors.paged import PagedChunk, PagedLayers, device_block_ids

__all__ = ["PagedSpanWriter"]


class PagedSpanWriter:
    """Writes spans into the registered layers' blocks.

    Args:
        layers: the engine's paged layers, in model order (this rank's part).
    """

    def __init__(self, layers: PagedLayers) -> None:
        self._layers = layers

    def write(self, kv: torch.Tensor, block_ids: tuple[int, ...], local_end: int, end: int) -> None:
        """Every layer's tokens ``[local_end, end)`` of ``kv`` (which starts at token 0) into ``block_ids``."""
        if end <= local_end:
            return
        ids = device_block_ids(block_ids, self._layers[0].cache.device)
        PagedChunk(self._layers, ids, kv[:, :, local_end:end]).scatter_all()
