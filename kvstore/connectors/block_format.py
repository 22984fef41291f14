"""Where K and V sit in an engine's paged KV block, read from the engine itself (``probe_block_format``).

How K and V sit inside a block differs by backend and version: vLLM 0.33 on CUDA packs K then V on the last axis of
a ``[blocks, heads, slots, 2*head_dim]`` view with strides that depend on the ``KVCacheLayout``; vLLM's CPU backend
stores K transposed (``[heads, head_dim, slots]``) then V (``[heads, slots, head_dim]``) in each block; older CUDA
versions split K and V on a leading axis. Rather than hard-code each, ``probe_block_format`` asks the backend's own
write kernel to store known values into block 0 and reads back where each (plane, slot, head, dim) element landed.
When each plane is a strided array (an affine map from (slot, head, dim) to memory), the format is a
``BlockFormat``, which ``kvstore.connectors.paged`` copies with; a format that is not strided (a packed tile layout)
is refused with one line.

Two engine shapes differ from plain K and V:

- an fp8 cache (``torch.uint8`` pages): the probe's values go through the backend's quantising write, so they are
  digits small enough to be exact in the fp8 format (4 bits for e4m3, 3 for e5m2) and are decoded from the landed
  bytes in that format (``storage_dtype``); a backend that stores another format than the layout names fails the
  probe. Copies then move bytes only, never values.
- an MLA cache (``[blocks, slots, latent]``): one plane per block (the latent; the model computes V from it), so
  ``BlockFormat.value`` is ``None`` and a chunk layer is ``[1, tokens, 1, latent]``.

Pure torch; the probe writes block 0 of the layer it is given (vLLM never hands block 0 to a request).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch

from kvstore.errors import ConfigError

__all__ = ["BlockFormat", "PlaneMap", "WriteLatent", "WriteSlots", "probe_block_format"]

WriteSlots = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
"""The backend's own cache write: ``write(key, value, slot_mapping)`` with key/value ``[tokens, heads, head_dim]``
stores token ``i`` into slot ``slot_mapping[i]`` of the layer tensor being probed."""

WriteLatent = Callable[[torch.Tensor, torch.Tensor], None]
"""An MLA backend's cache write: ``write(latent, slot_mapping)`` with latent ``[tokens, 1, latent_dim]`` (the
compressed KV, then the rotary part)."""

_EXACT_INTEGER_BITS = {
    torch.float32: 24,
    torch.float16: 11,
    torch.bfloat16: 8,
    torch.float8_e4m3fn: 4,
    torch.float8_e5m2: 3,
}
"""Integers below 2**bits are exact in each dtype: the probe writes codes as digits of that many bits."""

_UNWRITTEN = -1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class PlaneMap:
    """Where one plane (K or V) of a block lives, in elements from the block's first element."""

    offset: int
    token_stride: int
    head_stride: int
    dim_stride: int


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockFormat:
    """The element layout of one block of a layer's paged KV tensor (the same for every layer and block)."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    key: PlaneMap
    value: PlaneMap | None
    """``None`` for an MLA cache: ``key`` is then the latent, the block's one plane."""

    @property
    def num_planes(self) -> int:
        return 1 if self.value is None else 2

    def describe(self) -> str:
        def plane(name: str, plane_map: PlaneMap) -> str:
            return (
                f"{name} at +{plane_map.offset} (slot x{plane_map.token_stride}, head x{plane_map.head_stride}, "
                f"dim x{plane_map.dim_stride})"
            )

        if self.value is None:
            return f"{self.block_size}-slot blocks: {plane('latent', self.key)}"
        return f"{self.block_size}-slot blocks: {plane('K', self.key)}, {plane('V', self.value)}"

    def plane_view(self, layer_cache: torch.Tensor, plane: int) -> torch.Tensor:
        """``[num_blocks, block_size, num_kv_heads, head_dim]`` view of K (``plane=0``) or V of every block."""
        plane_map = self.value if plane == 1 and self.value is not None else self.key
        return torch.as_strided(
            layer_cache,
            size=(layer_cache.shape[0], self.block_size, self.num_kv_heads, self.head_dim),
            stride=(layer_cache.stride(0), plane_map.token_stride, plane_map.head_stride, plane_map.dim_stride),
            storage_offset=layer_cache.storage_offset() + plane_map.offset,
        )


def probe_block_format(
    layer_cache: torch.Tensor,
    *,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    write: WriteSlots | WriteLatent,
    num_planes: int = 2,
    storage_dtype: torch.dtype | None = None,
    source_dtype: torch.dtype | None = None,
) -> BlockFormat:
    """Read how ``write`` lays K and V (or an MLA latent) out in a block of ``layer_cache`` (dim 0 indexes blocks).

    Overwrites block 0 (vLLM never hands block 0 to a request) and zeroes it afterwards.

    Args:
        write: a ``WriteSlots`` (``num_planes=2``) or a ``WriteLatent`` (``num_planes=1``: an MLA cache).
        num_planes: 2 (K and V) or 1 (an MLA latent).
        storage_dtype: what an element of the cache is to the backend when its tensor's dtype says only bytes: the
            fp8 format of a ``torch.uint8`` cache (``KVDtype.storage_dtype``). Default: the cache's dtype.
        source_dtype: the dtype of the values ``write`` takes (the model's; a quantising write converts them).
            Default: ``storage_dtype``.

    Raises:
        ConfigError: the dtype cannot carry the probe, the write dropped or duplicated elements (or stored another
            fp8 format than ``storage_dtype``), or a plane is not a strided array of (slot, head, dim).
    """
    dtype = storage_dtype or layer_cache.dtype
    if dtype not in _EXACT_INTEGER_BITS or (dtype.itemsize != layer_cache.element_size()):
        raise ConfigError(
            f"paged KV of dtype {layer_cache.dtype} (read as {dtype}) is not supported; use float16, bfloat16, "
            "float32 or fp8 (e4m3, e5m2) KV"
        )
    if num_planes not in (1, 2):
        raise ConfigError(f"a paged KV block holds 1 (an MLA latent) or 2 (K, V) planes, not {num_planes}")
    plane_elements = block_size * num_kv_heads * head_dim
    num_codes = num_planes * plane_elements
    digit_bits = _EXACT_INTEGER_BITS[dtype]
    num_digits = math.ceil(math.log2(num_codes) / digit_bits) if num_codes > 1 else 1
    device = layer_cache.device
    codes = torch.arange(num_codes, device=device, dtype=torch.int64)
    block = layer_cache[0]
    readable = block.view(dtype)  # the bytes as the backend reads them (the block itself unless it is fp8 bytes)
    slots = torch.arange(block_size, device=device, dtype=torch.int64)
    decoded = torch.zeros(block.shape, device=device, dtype=torch.int64)
    for digit in range(num_digits):
        readable.copy_(torch.full((), _UNWRITTEN, dtype=dtype, device=device).expand(readable.shape))
        digits = ((codes >> (digit * digit_bits)) & ((1 << digit_bits) - 1)).to(source_dtype or dtype)
        planes = digits.view(num_planes, block_size, num_kv_heads, head_dim).unbind(0)
        if num_planes == 1:
            cast(WriteLatent, write)(planes[0].contiguous(), slots)
        else:
            cast(WriteSlots, write)(planes[0].contiguous(), planes[1].contiguous(), slots)
        landed = readable.to(torch.float32)
        written = landed != _UNWRITTEN
        decoded += torch.where(written, landed, 0).to(torch.int64) << (digit * digit_bits)
    block.zero_()
    return _fit_format(
        block,
        written,
        decoded,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_planes=num_planes,
    )


def _fit_format(
    block: torch.Tensor,
    written: torch.Tensor,
    decoded: torch.Tensor,
    *,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    num_planes: int = 2,
) -> BlockFormat:
    """Turn "element at memory offset m holds code c" into one strided map per plane, or refuse."""
    plane_elements = block_size * num_kv_heads * head_dim
    strides = torch.tensor(block.stride(), dtype=torch.int64)
    index_grids = torch.meshgrid(*[torch.arange(size) for size in block.shape], indexing="ij")
    memory_offsets = sum(grid * stride for grid, stride in zip(index_grids, strides, strict=True))
    assert isinstance(memory_offsets, torch.Tensor)
    found_codes = decoded.cpu()[written.cpu()]
    found_offsets = memory_offsets[written.cpu()]
    num_codes = num_planes * plane_elements
    if found_codes.numel() != num_codes or not torch.equal(torch.sort(found_codes).values, torch.arange(num_codes)):
        raise ConfigError(
            f"the KV cache write stored {found_codes.numel()} of {num_codes} probe values in a block; "
            "kvstore cannot read this backend's block format (or its fp8 format is not the layout's)"
        )
    offset_of_code = torch.empty(num_codes, dtype=torch.int64)
    offset_of_code[found_codes] = found_offsets
    planes = offset_of_code.view(num_planes, block_size, num_kv_heads, head_dim)
    return BlockFormat(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        key=_strided_plane(planes[0], "K" if num_planes == 2 else "latent"),
        value=_strided_plane(planes[1], "V") if num_planes == 2 else None,
    )


def _strided_plane(offsets: torch.Tensor, name: str) -> PlaneMap:
    """The strided map of one plane's ``[slots, heads, dims]`` memory offsets, or ``ConfigError``."""
    base = int(offsets[0, 0, 0])

    def step(index: tuple[int, int, int], size: int) -> int:
        return int(offsets[index]) - base if size > 1 else 0

    slots, heads, dims = offsets.shape
    plane_map = PlaneMap(
        offset=base,
        token_stride=step((1, 0, 0), slots),
        head_stride=step((0, 1, 0), heads),
        dim_stride=step((0, 0, 1), dims),
    )
    expected = (
        base
        + torch.arange(slots).view(-1, 1, 1) * plane_map.token_stride
        + torch.arange(heads).view(1, -1, 1) * plane_map.head_stride
        + torch.arange(dims).view(1, 1, -1) * plane_map.dim_stride
    )
    if not torch.equal(offsets, expected):
        raise ConfigError(
            f"the backend's {name} block layout is not a strided (slot, head, dim) array (a packed tile format?); "
            "kvstore cannot copy it"
        )
    return plane_map
