"""A client's shared-memory segments: one reusable scratch segment, and the KV buffers handed to the caller.

- **scratch**: where the client copies a plain tensor's KV before a store, and where the server writes a retrieve
  the caller did not direct into a buffer. It grows to the next power of two of the largest request (at least
  1 MiB) and is reused, so its pages are faulted in once.
- **buffers** (``Client.buffer``): segments the caller computes KV into (or retrieves into) directly; a store or
  retrieve on a tensor lying in one moves no bytes at all on the client side. ``region_of`` recognises such a
  tensor: the first ``n`` tokens of a ``[num_layers, 2, T, num_kv_heads, head_dim]`` buffer (a ``[:, :, :n]`` view
  of it included).

After the server restarts its mappings are gone and the names were unlinked, so nothing can be re-attached:
``forget_server`` drops every segment id; the scratch is recreated on demand and buffers stop being zero-copy
(their KV is copied through the scratch) until the caller makes new ones.

Threads: not thread-safe; ``kvstore.Client`` calls it under its request lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvstore.layout import KVLayout
from kvstore.wire.messages import ShmBulk
from kvstore.wire.shm import OwnedSegment, create_segment

__all__ = ["ClientSegments"]

logger = logging.getLogger(__name__)

_MIN_SCRATCH_BYTES = 1024 * 1024
_ALIGN_BYTES = 64


@dataclass(slots=True)
class _Attached:
    segment: OwnedSegment
    segment_id: int | None  # None: the server no longer maps it (it restarted)


class ClientSegments:
    """Segments of one client.

    Args:
        layout: the client's KV layout (buffers are shaped by it).
        attach: asks the server to map a segment; returns its id (raises when it cannot).
        detach: asks the server to unmap a segment (best effort).
    """

    def __init__(self, layout: KVLayout, attach: Callable[[OwnedSegment], int], detach: Callable[[int], None]) -> None:
        self._layout = layout
        self._attach = attach
        self._detach = detach
        self._scratch: _Attached | None = None
        self._buffers: dict[int, _Attached] = {}  # by the data pointer of the segment's storage

    def scratch(self, nbytes: int) -> tuple[torch.Tensor, int]:
        """A scratch region of at least ``nbytes`` bytes (``uint8``) and its segment id."""
        scratch = self._scratch
        if scratch is None or scratch.segment_id is None or scratch.segment.nbytes < nbytes:
            self._drop(scratch)
            self._scratch = None
            size = max(_MIN_SCRATCH_BYTES, 1 << max(nbytes - 1, 1).bit_length())
            segment = create_segment(size)
            self._scratch = scratch = _Attached(segment=segment, segment_id=self._attach(segment))
        assert scratch.segment_id is not None, "scratch segment left unattached"
        return scratch.segment.tensor, scratch.segment_id

    def new_buffer(self, num_tokens: int, shape: KVLayout | None = None) -> torch.Tensor:
        """A KV buffer ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]`` in a segment the server maps, shaped
        by ``shape`` when given (a part's ``KVPart.shape_layout``) and by the client's layout otherwise."""
        layout = shape or self._layout
        nbytes = layout.chunk_bytes(num_tokens)
        segment = create_segment(max(_ALIGN_BYTES, nbytes))
        self._buffers[segment.tensor.untyped_storage().data_ptr()] = _Attached(
            segment=segment, segment_id=self._attach(segment)
        )
        raw = segment.tensor[:nbytes]
        return raw.view(layout.dtype.torch_dtype).view(layout.chunk_shape(num_tokens))

    def release_buffer(self, buffer: torch.Tensor) -> bool:
        """Unmap a buffer from the server (the caller's tensor stays valid). ``False`` when it is not one."""
        attached = self._buffers.pop(buffer.untyped_storage().data_ptr(), None)
        self._drop(attached)
        return attached is not None

    def region_of(self, tensor: torch.Tensor, min_tokens: int, shape: KVLayout | None = None) -> ShmBulk | None:
        """The buffer region holding ``tensor`` -- the first tokens of a ``[L, 2, T, H, D]`` block with
        ``T >= min_tokens``, in the client's layout or ``shape`` -- or ``None`` when the tensor is not laid out that
        way inside an attached buffer."""
        if tensor.device.type != "cpu" or tensor.dim() != 5:
            return None
        attached = self._buffers.get(tensor.untyped_storage().data_ptr())
        if attached is None or attached.segment_id is None:
            return None
        layout = shape or self._layout
        heads, head_dim = layout.num_kv_heads, layout.head_dim
        token_stride = heads * head_dim
        stride = tensor.stride()
        if stride[3:] != (head_dim, 1) or stride[2] != token_stride or stride[1] % token_stride:
            return None
        total_tokens = stride[1] // token_stride
        if stride[0] != 2 * stride[1] or total_tokens < max(min_tokens, tensor.shape[2]):
            return None
        offset = int(tensor.storage_offset()) * tensor.element_size()
        nbytes = layout.chunk_bytes(total_tokens)
        if offset % _ALIGN_BYTES or offset + nbytes > attached.segment.nbytes:
            return None
        return ShmBulk(segment_id=attached.segment_id, offset=offset, nbytes=nbytes)

    def forget_server(self) -> None:
        """The server restarted: no segment is mapped there any more."""
        if self._scratch is not None:
            self._scratch.segment_id = None
        for attached in self._buffers.values():
            attached.segment_id = None

    def _drop(self, attached: _Attached | None) -> None:
        if attached is not None and attached.segment_id is not None:
            self._detach(attached.segment_id)
            attached.segment_id = None

    def close(self) -> None:
        """Drop every segment (their memory goes once the caller's buffer tensors are gone too)."""
        self._scratch = None
        self._buffers.clear()
