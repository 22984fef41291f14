"""How a retrieve moves KV into the caller's buffer: the buffer checked (or made), memory chunks copied (whole, or a
few layers at a time for a caller that computes while they land), disk chunks decoded through a scratch buffer
when the caller's place is not one the decoder can write.

Threads: ``DiskReads`` is shared by every retrieve of a store (its scratch buffer is guarded); the functions hold
no state.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from kvstore.errors import InvalidInputError
from kvstore.keys import PrefixKey
from kvstore.layout import KVLayout
from kvstore.plan import RetrieveProgress
from kvstore.tiers.base import Tier

__all__ = ["LAYERS_PER_STEP", "DiskReads", "copy_from_memory", "prepared_out"]

LAYERS_PER_STEP = 4
"""Layers a layer-by-layer retrieve copies per step. Each step is one copy per chunk (its layers are contiguous in
the chunk), so an 8B prompt of 60 chunks takes 480 host-to-device copies instead of 3,840 for K and V of every layer:
the per-copy host cost competed with the prefill's own kernel launches. The first step (4 of 32 layers, from pinned
memory) lands while layer 0 computes (measured: docs/design-notes.md#store)."""


def prepared_out(layout: KVLayout, needed: int, out: torch.Tensor | None, device: str | torch.device) -> torch.Tensor:
    """``out`` checked to hold ``needed`` tokens in the layout, or a new tensor on ``device``.

    Raises:
        InvalidInputError: ``out`` has the wrong shape or dtype.
    """
    if out is None:
        return torch.empty(layout.chunk_shape(needed), dtype=layout.dtype.torch_dtype, device=device)
    if out.dim() != 5 or out.shape[2] < needed:
        raise InvalidInputError(
            f"out shape {list(out.shape)} cannot hold the plan's {needed} tokens; "
            f"expected {list(layout.chunk_shape(needed))} (or more tokens)"
        )
    layout.check_kv(out[:, :, :needed], needed)
    return out


def copy_from_memory(
    copies: Sequence[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    progress: RetrieveProgress | None,
    num_layers: int,
) -> None:
    """Copy pinned chunks and decoded tails (``(source, place)`` pairs) into the caller's buffer: whole chunks, or
    layers-first steps when someone watches.

    Copies to a device are queued without waiting (pinned host memory, or device memory) and awaited once at the end,
    before the caller drops the pins: a chunk must not be evicted and overwritten while a copy out of it is still in
    flight.
    """
    asynchronous = device.type == "cuda"
    if progress is None:
        for source, place in copies:
            place.copy_(source, non_blocking=asynchronous)
    else:
        for first in range(0, num_layers, LAYERS_PER_STEP):
            last = min(first + LAYERS_PER_STEP, num_layers)
            places = [place[first:last] for _, place in copies]
            sources = [source[first:last] for source, _ in copies]
            if places:  # one call queues the step's copies of every chunk
                torch._foreach_copy_(places, sources, non_blocking=asynchronous)
            for layer in range(first, last):
                progress.layer_queued(layer)
    if asynchronous and copies:
        torch.cuda.current_stream(device).synchronize()


class DiskReads:
    """Decodes disk chunks into any place: straight into a contiguous cpu place, else through one scratch buffer.

    Args:
        disk: the disk tier.
        layout: the model's KV layout.
        chunk_size: tokens per full chunk (the scratch buffer holds one).
    """

    def __init__(self, disk: Tier, layout: KVLayout, chunk_size: int) -> None:
        self._disk = disk
        self._layout = layout
        self._chunk_size = chunk_size
        self._scratch_lock = threading.Lock()
        self._scratch: torch.Tensor | None = None

    def load_into(self, key: PrefixKey, num_tokens: int, out: torch.Tensor) -> bool:
        """Decode chunk ``key`` into ``out``; ``False`` on a miss or a corrupt chunk."""
        if out.device.type == "cpu" and out.is_contiguous():
            return self._disk.get_into(key, out)
        with self._scratch_lock:
            scratch = self._scratch_for(num_tokens)
            if not self._disk.get_into(key, scratch):
                return False
            out.copy_(scratch)
            return True

    def _scratch_for(self, num_tokens: int) -> torch.Tensor:
        if self._scratch is None:
            self._scratch = torch.empty(
                self._layout.chunk_bytes(self._chunk_size), dtype=torch.uint8, pin_memory=torch.cuda.is_available()
            )
        raw = self._scratch[: self._layout.chunk_bytes(num_tokens)]
        return raw.view(self._layout.dtype.torch_dtype).view(self._layout.chunk_shape(num_tokens))
