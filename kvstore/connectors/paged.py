"""Moving KV between an engine's paged blocks and kvstore chunks, in a block format read from the engine itself.

A paged KV cache holds, per layer, ``num_blocks`` blocks of ``block_size`` token slots (token ``t`` of a request
lives in slot ``t % block_size`` of its ``t // block_size``-th block). How K and V sit inside a block differs by
backend and version: vLLM 0.33 on CUDA packs K then V on the last axis of a ``[blocks, heads, slots, 2*head_dim]``
view with strides that depend on the ``KVCacheLayout``; vLLM's CPU backend stores K transposed (``[heads,
head_dim, slots]``) then V (``[heads, slots, head_dim]``) in each block; older CUDA versions split K and V on a
leading axis. Rather than hard-code each, ``probe_block_format`` asks the backend's own write kernel to store
known values into block 0 and reads back where each (plane, slot, head, dim) element landed. When each plane
is a strided array (an affine map from (slot, head, dim) to memory), the format is a ``BlockFormat`` and every copy
is one strided view plus one batched ``index_select`` / ``index_copy_`` per plane and layer: no Python loop over
tokens or blocks. A format that is not strided (a packed tile layout) is refused with one line.

A kvstore chunk's layer is ``[2, num_tokens, num_kv_heads, head_dim]`` (K plane, V plane): ``gather_blocks`` fills
it from blocks, ``scatter_blocks`` writes it into blocks.

Pure torch; works on any device the tensors share. Not thread-safe per layer tensor (callers own their blocks).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvstore.errors import ConfigError, InvalidInputError

__all__ = [
    "BlockFormat",
    "PagedLayer",
    "PlaneMap",
    "WriteSlots",
    "gather_blocks",
    "probe_block_format",
    "scatter_blocks",
]

WriteSlots = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
"""The backend's own cache write: ``write(key, value, slot_mapping)`` with key/value ``[tokens, heads, head_dim]``
stores token ``i`` into slot ``slot_mapping[i]`` of the layer tensor being probed."""

_EXACT_INTEGER_BITS = {torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}
"""Integers below 2**bits are exact in each dtype: the probe writes codes as digits of that many bits."""

_UNWRITTEN = -1.0
_WIDE_DTYPE = torch.complex128
"""A 16-byte element for the fused path: index_select / index_copy_ only load and store it (bitwise copies)."""


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
    value: PlaneMap

    def describe(self) -> str:
        def plane(name: str, plane_map: PlaneMap) -> str:
            return (
                f"{name} at +{plane_map.offset} (slot x{plane_map.token_stride}, head x{plane_map.head_stride}, "
                f"dim x{plane_map.dim_stride})"
            )

        return f"{self.block_size}-slot blocks: {plane('K', self.key)}, {plane('V', self.value)}"

    def plane_view(self, layer_cache: torch.Tensor, plane: int) -> torch.Tensor:
        """``[num_blocks, block_size, num_kv_heads, head_dim]`` view of K (``plane=0``) or V of every block."""
        plane_map = self.key if plane == 0 else self.value
        return torch.as_strided(
            layer_cache,
            size=(layer_cache.shape[0], self.block_size, self.num_kv_heads, self.head_dim),
            stride=(layer_cache.stride(0), plane_map.token_stride, plane_map.head_stride, plane_map.dim_stride),
            storage_offset=layer_cache.storage_offset() + plane_map.offset,
        )


def probe_block_format(
    layer_cache: torch.Tensor, *, block_size: int, num_kv_heads: int, head_dim: int, write: WriteSlots
) -> BlockFormat:
    """Read how ``write`` lays K and V out in a block of ``layer_cache`` (whose dim 0 indexes blocks).

    Overwrites block 0 (vLLM never hands block 0 to a request) and zeroes it afterwards.

    Raises:
        ConfigError: the dtype cannot carry the probe, the write dropped or duplicated elements, or a plane is not
            a strided array of (slot, head, dim).
    """
    dtype = layer_cache.dtype
    if dtype not in _EXACT_INTEGER_BITS:
        raise ConfigError(f"paged KV of dtype {dtype} is not supported; use float16, bfloat16 or float32 KV")
    plane_elements = block_size * num_kv_heads * head_dim
    num_codes = 2 * plane_elements
    digit_bits = _EXACT_INTEGER_BITS[dtype]
    num_digits = math.ceil(math.log2(num_codes) / digit_bits) if num_codes > 1 else 1
    device = layer_cache.device
    codes = torch.arange(num_codes, device=device, dtype=torch.int64)
    block = layer_cache[0]
    slots = torch.arange(block_size, device=device, dtype=torch.int64)
    decoded = torch.zeros(block.shape, device=device, dtype=torch.int64)
    for digit in range(num_digits):
        block.fill_(_UNWRITTEN)
        digits = ((codes >> (digit * digit_bits)) & ((1 << digit_bits) - 1)).to(dtype)
        key, value = digits.view(2, block_size, num_kv_heads, head_dim).unbind(0)
        write(key.contiguous(), value.contiguous(), slots)
        landed = block.to(torch.float32)
        written = landed != _UNWRITTEN
        decoded += torch.where(written, landed, 0).to(torch.int64) << (digit * digit_bits)
    block.zero_()
    return _fit_format(block, written, decoded, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim)


def _fit_format(
    block: torch.Tensor,
    written: torch.Tensor,
    decoded: torch.Tensor,
    *,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
) -> BlockFormat:
    """Turn "element at memory offset m holds code c" into one strided map per plane, or refuse."""
    plane_elements = block_size * num_kv_heads * head_dim
    strides = torch.tensor(block.stride(), dtype=torch.int64)
    index_grids = torch.meshgrid(*[torch.arange(size) for size in block.shape], indexing="ij")
    memory_offsets = sum(grid * stride for grid, stride in zip(index_grids, strides, strict=True))
    assert isinstance(memory_offsets, torch.Tensor)
    found_codes = decoded.cpu()[written.cpu()]
    found_offsets = memory_offsets[written.cpu()]
    if found_codes.numel() != 2 * plane_elements or not torch.equal(
        torch.sort(found_codes).values, torch.arange(2 * plane_elements)
    ):
        raise ConfigError(
            f"the KV cache write stored {found_codes.numel()} of {2 * plane_elements} probe values in a block; "
            "kvstore cannot read this backend's block format"
        )
    offset_of_code = torch.empty(2 * plane_elements, dtype=torch.int64)
    offset_of_code[found_codes] = found_offsets
    planes = offset_of_code.view(2, block_size, num_kv_heads, head_dim)
    return BlockFormat(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        key=_strided_plane(planes[0], "K"),
        value=_strided_plane(planes[1], "V"),
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


class PagedLayer:
    """One layer's paged KV tensor and the views its copies use, built once.

    A copy per layer then costs a few checks, one view of the chunk and one index call (two per plane when the format
    cannot be fused): on a GPU the copy of one layer of a long prompt is short (measured:
    docs/design-notes.md#connectors-paged), so host work per call is what decides whether copies keep up with the
    device.

    Args:
        cache: the layer's tensor, dim 0 indexing blocks.
        block_format: where K and V sit in a block (``probe_block_format``).
    """

    def __init__(self, cache: torch.Tensor, block_format: BlockFormat) -> None:
        self.cache = cache
        self.block_format = block_format
        self._planes = (block_format.plane_view(cache, 0), block_format.plane_view(cache, 1))
        self._wide_blocks = _wide_blocks(cache, block_format)

    def gather(self, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the first ``out.shape[1]`` token slots of ``block_ids`` (in order) into ``out`` ``[2, tokens,
        heads, head_dim]``; the last block may be partly used.

        Raises:
            InvalidInputError: ``out`` needs more blocks than given, or its shape or dtype does not fit.
        """
        block_format = self.block_format
        num_tokens = _check_chunk_layer(self.cache, block_format, block_ids, out)
        num_full = num_tokens // block_format.block_size
        tail = num_tokens - num_full * block_format.block_size
        wide_blocks = self._wide_blocks
        chunk_blocks = self._wide_chunk(out, num_full) if num_full and wide_blocks is not None else None
        if wide_blocks is not None and chunk_blocks is not None:
            torch.index_select(wide_blocks, 0, block_ids[:num_full], out=chunk_blocks)
        elif num_full:
            for plane, view in enumerate(self._planes):
                torch.index_select(view, 0, block_ids[:num_full], out=_plane_blocks(out, plane, num_full, block_format))
        if tail:
            last_block = int(block_ids[num_full])
            for plane, view in enumerate(self._planes):
                out[plane, num_full * block_format.block_size :].copy_(view[last_block][:tail])

    def scatter(self, block_ids: torch.Tensor, source: torch.Tensor) -> None:
        """Write ``source`` ``[2, tokens, heads, head_dim]`` into whole blocks ``block_ids`` (tokens = blocks x
        block size).

        Raises:
            InvalidInputError: the token count is not ``len(block_ids) * block_size``, or shapes or dtypes differ.
        """
        block_format = self.block_format
        num_tokens = _check_chunk_layer(self.cache, block_format, block_ids, source)
        num_blocks = len(block_ids)
        if num_tokens != num_blocks * block_format.block_size:
            raise InvalidInputError(
                f"a scatter fills whole blocks: {num_tokens} tokens for {num_blocks} blocks of "
                f"{block_format.block_size}"
            )
        wide_blocks = self._wide_blocks
        chunk_blocks = self._wide_chunk(source, num_blocks) if wide_blocks is not None else None
        if wide_blocks is not None and chunk_blocks is not None:
            wide_blocks.index_copy_(0, block_ids, chunk_blocks)
            return
        for plane, view in enumerate(self._planes):
            view.index_copy_(0, block_ids, _plane_blocks(source, plane, num_blocks, block_format))

    def _wide_chunk(self, chunk_layer: torch.Tensor, num_blocks: int) -> torch.Tensor | None:
        """``[num_blocks, 2, slots, heads, head_dim / r]`` of the chunk in 16-byte elements, or ``None`` when it
        is not 16-byte aligned."""
        ratio = _WIDE_DTYPE.itemsize // chunk_layer.element_size()
        if chunk_layer.storage_offset() % ratio or chunk_layer.stride(0) % ratio or chunk_layer.data_ptr() % 16:
            return None
        try:
            wide = chunk_layer.view(_WIDE_DTYPE)
        except RuntimeError:
            return None
        block_format = self.block_format
        slots, heads = block_format.block_size, block_format.num_kv_heads
        wide_dim = block_format.head_dim // ratio
        token_stride = heads * wide_dim
        return torch.as_strided(
            wide,
            size=(num_blocks, 2, slots, heads, wide_dim),
            stride=(slots * token_stride, chunk_layer.stride(0) // ratio, token_stride, wide_dim, 1),
            storage_offset=wide.storage_offset(),
        )


def gather_blocks(
    layer_cache: torch.Tensor, block_format: BlockFormat, block_ids: torch.Tensor, out: torch.Tensor
) -> None:
    """``PagedLayer.gather`` for a one-off copy (a connector keeps one ``PagedLayer`` per layer)."""
    PagedLayer(layer_cache, block_format).gather(block_ids, out)


def scatter_blocks(
    layer_cache: torch.Tensor, block_format: BlockFormat, block_ids: torch.Tensor, source: torch.Tensor
) -> None:
    """``PagedLayer.scatter`` for a one-off copy (a connector keeps one ``PagedLayer`` per layer)."""
    PagedLayer(layer_cache, block_format).scatter(block_ids, source)


def _plane_blocks(chunk_layer: torch.Tensor, plane: int, num_blocks: int, block_format: BlockFormat) -> torch.Tensor:
    """The chunk's first ``num_blocks`` blocks of one plane: ``[num_blocks, slots, heads, head_dim]``."""
    shape = (num_blocks, block_format.block_size, block_format.num_kv_heads, block_format.head_dim)
    return chunk_layer[plane, : num_blocks * block_format.block_size].view(shape)


def _wide_blocks(cache: torch.Tensor, block_format: BlockFormat) -> torch.Tensor | None:
    """Both planes of every block, ``[blocks, 2, slots, heads, head_dim / r]`` in 16-byte elements; ``None`` when K
    and V do not share strides, a head's dims are not contiguous, or an offset or stride is not 16-byte aligned."""
    key, value = block_format.key, block_format.value
    ratio = _WIDE_DTYPE.itemsize // cache.element_size()
    if (
        key.dim_stride != 1
        or value.dim_stride != 1
        or (key.token_stride, key.head_stride) != (value.token_stride, value.head_stride)
        or block_format.head_dim % ratio
        or any(step % ratio for step in (key.offset, value.offset, key.token_stride, key.head_stride))
        or cache.storage_offset() % ratio
        or cache.stride(0) % ratio
        or cache.data_ptr() % _WIDE_DTYPE.itemsize
    ):
        return None
    try:
        wide = cache.view(_WIDE_DTYPE)
    except RuntimeError:  # the last dim is not contiguous, or a size is not a multiple of 16 bytes
        return None
    return torch.as_strided(
        wide,
        size=(cache.shape[0], 2, block_format.block_size, block_format.num_kv_heads, block_format.head_dim // ratio),
        stride=(
            cache.stride(0) // ratio,
            (value.offset - key.offset) // ratio,
            key.token_stride // ratio,
            key.head_stride // ratio,
            1,
        ),
        storage_offset=wide.storage_offset() + key.offset // ratio,
    )


def _check_chunk_layer(
    layer_cache: torch.Tensor, block_format: BlockFormat, block_ids: torch.Tensor, chunk_layer: torch.Tensor
) -> int:
    """The chunk layer's token count, after checking it fits the blocks. Every copy runs this on the engine's
    path (a layer of a long prompt copies in tens of microseconds on a GPU), so it reads shape and strides once
    and builds no views."""
    heads, head_dim = block_format.num_kv_heads, block_format.head_dim
    shape = chunk_layer.shape
    if len(shape) != 4 or shape[0] != 2 or shape[2] != heads or shape[3] != head_dim:
        raise InvalidInputError(f"chunk layer shape {list(shape)} is not [2, tokens, {heads}, {head_dim}]")
    if chunk_layer.dtype != layer_cache.dtype or chunk_layer.device != layer_cache.device:
        raise InvalidInputError(
            f"chunk layer is {chunk_layer.dtype} on {chunk_layer.device}; the paged cache is {layer_cache.dtype} "
            f"on {layer_cache.device}"
        )
    num_tokens = shape[1]
    _, token_stride, head_stride, dim_stride = chunk_layer.stride()
    # each plane [tokens, heads, head_dim] contiguous (a stride of a size-1 axis is free)
    if (
        (head_dim > 1 and dim_stride != 1)
        or (heads > 1 and head_stride != head_dim)
        or (num_tokens > 1 and token_stride != heads * head_dim)
    ):
        raise InvalidInputError("each plane of a chunk layer must be contiguous ([tokens, heads, head_dim])")
    if num_tokens > len(block_ids) * block_format.block_size:
        raise InvalidInputError(
            f"{num_tokens} tokens do not fit in {len(block_ids)} blocks of {block_format.block_size} slots"
        )
    return int(num_tokens)
