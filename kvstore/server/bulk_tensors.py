"""The tensor a request's bulk reference names: a view of a client's shared-memory segment, a view of the inline
payload frame, or an opened CUDA IPC handle (checked against the layout and the token count, never copied).

Threads: no state; any worker calls these.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvstore.errors import InvalidInputError
from kvstore.layout import KVLayout
from kvstore.wire.cuda_ipc import import_cuda_tensor
from kvstore.wire.error_codes import ErrorCode, RequestError
from kvstore.wire.messages import BulkRef, CudaIpcBulk, InlineBulk, ShmBulk

__all__ = ["bulk_tensor", "transport_of"]


def bulk_tensor(
    bulk: BulkRef,
    layout: KVLayout,
    num_tokens: int,
    payload: memoryview | None,
    segment_of: Callable[[int], torch.Tensor],
) -> torch.Tensor:
    """The tensor a bulk reference names: ``[num_layers, 2, T, num_kv_heads, head_dim]`` with ``T >= num_tokens``
    (``T == num_tokens`` inline; a shared-memory region or CUDA tensor may hold more tokens).

    Raises:
        RequestError: a missing or extra payload, a size that does not match, an unknown segment.
    """
    nbytes = layout.chunk_bytes(num_tokens)
    shape = layout.chunk_shape(num_tokens)
    dtype = layout.dtype.torch_dtype
    if isinstance(bulk, CudaIpcBulk):
        tensor = import_cuda_tensor(bulk.handle)
        try:
            layout.check_kv(tensor[:, :, :num_tokens] if tensor.dim() == 5 else tensor, num_tokens)
        except InvalidInputError as exc:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"cuda_ipc tensor: {exc}") from None
        return tensor
    if isinstance(bulk, InlineBulk):
        if payload is None:
            raise RequestError(ErrorCode.MALFORMED, "bulk kind inline needs the KV as the payload frame")
        if len(payload) != nbytes:
            raise RequestError(
                ErrorCode.INVALID_ARGUMENT,
                f"payload is {len(payload):,} bytes; {num_tokens} tokens of {layout.model_id} need {nbytes:,}",
            )
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        if payload.readonly:  # ZeroMQ frames are writable; a read-only buffer gets one copy (torch needs writable)
            payload = memoryview(bytearray(payload))
        return torch.frombuffer(payload, dtype=torch.uint8).view(dtype).view(shape)
    if payload is not None:
        raise RequestError(ErrorCode.MALFORMED, "bulk kind shm takes no payload frame")
    assert isinstance(bulk, ShmBulk), f"bulk {bulk!r} of no known kind reached bulk_tensor"
    region_tokens, remainder = divmod(bulk.nbytes, layout.bytes_per_token)
    if remainder or region_tokens < num_tokens:
        raise RequestError(
            ErrorCode.INVALID_ARGUMENT,
            f"bulk nbytes={bulk.nbytes:,} is not a whole number of tokens of at least {num_tokens} "
            f"({layout.bytes_per_token:,} bytes a token for {layout.model_id}: {nbytes:,} bytes)",
        )
    segment = segment_of(bulk.segment_id)
    if bulk.offset + bulk.nbytes > segment.numel():
        raise RequestError(
            ErrorCode.INVALID_ARGUMENT,
            f"bulk region [{bulk.offset}, {bulk.offset + bulk.nbytes}) lies outside segment {bulk.segment_id} "
            f"({segment.numel():,} bytes)",
        )
    region = segment[bulk.offset : bulk.offset + bulk.nbytes]
    return region.view(dtype).view(layout.chunk_shape(region_tokens))


def transport_of(bulk: BulkRef) -> str:
    """The metric label of a bulk's transport."""
    if isinstance(bulk, ShmBulk):
        return "shm"
    if isinstance(bulk, CudaIpcBulk):
        return "cuda_ipc"
    return "inline"
