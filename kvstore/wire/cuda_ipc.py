"""CUDA tensors shared between processes by IPC handle: the ``cuda_ipc`` bulk kind.

A client on the same host with its KV in GPU memory sends a handle instead of bytes: torch's own CUDA IPC
reduction (``torch.multiprocessing.reductions.reduce_tensor``: ``cudaIpcGetMemHandle`` of the caching allocator's
block, a ref-counter slot and an event) flattened into a msgpack map. The server opens it with torch's
``rebuild_cuda_tensor`` and copies device to device: a store reads the client's tensor, a retrieve writes into it
(and synchronises before replying, so the client may use the tensor as soon as the reply arrives). The client
keeps its tensor alive for the duration of the request, which is all the IPC contract asks.

A handle is the client's word, and a wrong word would make the server touch device memory outside the client's
allocation: an illegal-address fault, which poisons the server's whole CUDA context (every later GPU request fails).
So the server checks, before any copy, that the view lies inside the storage the handle names (``parse``) and
that the storage lies inside the allocation the driver really mapped (``cuMemGetAddressRange`` after opening).

Only exercised on a CUDA machine (tests marked ``gpu``); without CUDA, ``export_cuda_tensor`` refuses and a server
answers a ``cuda_ipc`` request with a ``config`` error.

Pure functions; thread-safe (torch's IPC cache has its own lock).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from kvstore.errors import ConfigError
from kvstore.layout import KVDtype
from kvstore.wire.error_codes import ErrorCode, RequestError
from kvstore.wire.fields import Fields

__all__ = ["CudaIpcHandle", "export_cuda_tensor", "import_cuda_tensor"]

_MAX_HANDLE_BYTES = 256
_MAX_DIMS = 8
_MAX_SIZE = 2**48


@dataclass(frozen=True, slots=True, kw_only=True)
class CudaIpcHandle:
    """What torch needs to open another process's CUDA tensor (the fields of ``reduce_tensor``'s CUDA branch)."""

    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    tensor_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: KVDtype

    @classmethod
    def parse(cls, fields: Fields) -> CudaIpcHandle:
        """Read a handle map (finished here)."""

        def dims(name: str) -> tuple[int, ...]:
            values = fields.list_(name, _MAX_DIMS)
            if any(type(value) is not int or not 0 <= value <= _MAX_SIZE for value in values):
                raise RequestError(ErrorCode.INVALID_ARGUMENT, f"cuda_ipc handle: {name} must be non-negative ints")
            return tuple(int(value) for value in values)  # type: ignore[call-overload]

        dtype_name = fields.required_str("dtype", 16)
        try:
            dtype = KVDtype.parse(dtype_name)
        except ConfigError as exc:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"cuda_ipc handle: {exc}") from None
        handle = cls(
            device=fields.required_int("device", 0, 1024),
            handle=fields.bytes_("handle", max_length=_MAX_HANDLE_BYTES),
            storage_size_bytes=fields.required_int("storage_size_bytes", 0, _MAX_SIZE),
            storage_offset_bytes=fields.required_int("storage_offset_bytes", 0, _MAX_SIZE),
            ref_counter_handle=fields.bytes_("ref_counter_handle", max_length=_MAX_HANDLE_BYTES),
            ref_counter_offset=fields.required_int("ref_counter_offset", 0, _MAX_SIZE),
            event_handle=fields.bytes_("event_handle", max_length=_MAX_HANDLE_BYTES),
            event_sync_required=fields.required_bool("event_sync_required"),
            tensor_offset=fields.required_int("tensor_offset", 0, _MAX_SIZE),
            shape=dims("shape"),
            stride=dims("stride"),
            dtype=dtype,
        )
        fields.finish()
        if len(handle.shape) != len(handle.stride):
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "cuda_ipc handle: shape and stride differ in length")
        if handle.view_end_bytes() > handle.storage_size_bytes:
            raise RequestError(
                ErrorCode.INVALID_ARGUMENT,
                f"cuda_ipc handle: the view ends at byte {handle.view_end_bytes():,}, past its storage's "
                f"{handle.storage_size_bytes:,} bytes",
            )
        return handle

    def view_end_bytes(self) -> int:
        """One past the last byte of the storage the view touches (0 for an empty view)."""
        if any(size == 0 for size in self.shape):
            return 0
        last_element = self.tensor_offset + sum(
            (size - 1) * stride for size, stride in zip(self.shape, self.stride, strict=True)
        )
        return (last_element + 1) * self.dtype.element_size_bytes

    def to_wire(self) -> dict[str, object]:
        return {
            "device": self.device,
            "handle": self.handle,
            "storage_size_bytes": self.storage_size_bytes,
            "storage_offset_bytes": self.storage_offset_bytes,
            "ref_counter_handle": self.ref_counter_handle,
            "ref_counter_offset": self.ref_counter_offset,
            "event_handle": self.event_handle,
            "event_sync_required": self.event_sync_required,
            "tensor_offset": self.tensor_offset,
            "shape": list(self.shape),
            "stride": list(self.stride),
            "dtype": self.dtype.value,
        }


def export_cuda_tensor(tensor: torch.Tensor) -> CudaIpcHandle:
    """A handle another process on this host can open; keep ``tensor`` alive until that process is done.

    Raises:
        ConfigError: the tensor is not on a CUDA device.
    """
    if tensor.device.type != "cuda":
        raise ConfigError(f"cuda_ipc shares CUDA tensors; this one is on {tensor.device}")
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(tensor)  # type: ignore[no-untyped-call]
    (_, size, stride, tensor_offset, _, dtype, device, handle, storage_size_bytes, storage_offset_bytes, _,
     ref_counter_handle, ref_counter_offset, event_handle, event_sync_required) = args  # fmt: skip
    return CudaIpcHandle(
        device=int(device),
        handle=bytes(handle),
        storage_size_bytes=int(storage_size_bytes),
        storage_offset_bytes=int(storage_offset_bytes),
        ref_counter_handle=bytes(ref_counter_handle),
        ref_counter_offset=int(ref_counter_offset),
        event_handle=bytes(event_handle) if event_handle is not None else b"",
        event_sync_required=bool(event_sync_required),
        tensor_offset=int(tensor_offset),
        shape=tuple(int(s) for s in size),
        stride=tuple(int(s) for s in stride),
        dtype=KVDtype.parse(dtype),
    )


def import_cuda_tensor(handle: CudaIpcHandle) -> torch.Tensor:
    """Open a tensor another process exported with ``export_cuda_tensor``.

    Raises:
        ConfigError: this process has no CUDA, or the handle cannot be opened (another host, a freed tensor).
    """
    if not torch.cuda.is_available():
        raise ConfigError(
            "a cuda_ipc bulk reference needs a server with CUDA on the same host; send the KV through shared "
            "memory instead (a cpu tensor)"
        )
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        tensor: torch.Tensor = rebuild_cuda_tensor(  # type: ignore[no-untyped-call]
            torch.Tensor,
            torch.Size(handle.shape),
            handle.stride,
            handle.tensor_offset,
            torch.storage.TypedStorage,
            handle.dtype.torch_dtype,
            handle.device,
            handle.handle,
            handle.storage_size_bytes,
            handle.storage_offset_bytes,
            False,
            handle.ref_counter_handle,
            handle.ref_counter_offset,
            handle.event_handle or None,
            handle.event_sync_required,
        )
    except RuntimeError as exc:
        raise ConfigError(f"cannot open the cuda_ipc handle (another host, or a freed tensor?): {exc}") from exc
    storage_start = tensor.untyped_storage().data_ptr()
    allocation = _allocation_range(storage_start)
    if allocation is not None and storage_start + handle.storage_size_bytes > allocation[0] + allocation[1]:
        raise RequestError(
            ErrorCode.INVALID_ARGUMENT,
            f"cuda_ipc handle: its storage of {handle.storage_size_bytes:,} bytes runs past the end of the "
            f"allocation it names ({allocation[0] + allocation[1] - storage_start:,} bytes left there)",
        )
    return tensor


def _allocation_range(pointer: int) -> tuple[int, int] | None:
    """The device allocation holding ``pointer``: ``(base, size)`` from the driver, or ``None`` when the driver
    library cannot be asked (the storage/view check in ``parse`` still holds)."""
    driver = _cuda_driver()
    if driver is None:
        return None
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    if driver.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(pointer)) != 0:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, "cuda_ipc handle: the driver knows no allocation there")
    return base.value, size.value


@functools.cache
def _cuda_driver() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
