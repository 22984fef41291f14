"""Moving KV between an engine's paged blocks and kvstore chunks, in a block format read from the engine itself.

A paged KV cache holds, per layer, ``num_blocks`` blocks of ``block_size`` token slots (token ``t`` of a request
lives in slot ``t % block_size`` of its ``t // block_size``-th block). Where K and V sit inside a block is a
``BlockFormat`` the connector probes from the engine's backend (``kvstore.connectors.block_format``); every copy is
then one strided view plus one batched ``index_select`` / ``index_copy_`` per plane and layer: no Python loop over
tokens or blocks.

A kvstore chunk's layer is ``[2, num_tokens, num_kv_heads, head_dim]`` (K plane, V plane; an MLA cache's is
``[1, tokens, 1, latent]``). A connector keeps the engine's layers once (``PagedLayers``), binds a request's chunk of
every layer to its blocks (``PagedChunk``) and copies every layer at once (one kernel launch on CUDA where Triton
imports: ``paged_triton``) or one layer at a time; ``gather_blocks`` / ``scatter_blocks`` are the one-off copies of
one layer.

Pure torch; works on any device the tensors share. Not thread-safe per layer tensor (callers own their blocks).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import torch

from kvstore.connectors.block_format import BlockFormat
from kvstore.connectors.paged_triton import RequestKernel
from kvstore.errors import InvalidInputError

__all__ = [
    "PagedChunk",
    "PagedLayer",
    "PagedLayers",
    "device_block_ids",
    "gather_blocks",
    "scatter_blocks",
]

logger = logging.getLogger(__name__)

_WIDE_DTYPE = torch.complex128
"""A 16-byte element for the fused path: index_select / index_copy_ only load and store it (bitwise copies)."""


class PagedLayer:
    """One layer's paged KV tensor and the views of it every copy uses, built once per layer (a connector keeps one
    per layer for the engine's life).

    Attributes:
        cache: the layer's tensor, dim 0 indexing blocks.
        block_format: where K and V sit in a block (``probe_block_format``).
        planes: ``[blocks, slots, heads, head_dim]`` views of K and of V.
        wide_blocks: ``[blocks, 2, slots, heads, head_dim / r]``, both planes in 16-byte elements, or ``None``
            when the format cannot be fused (K and V with different strides, or not 16-byte aligned).
    """

    def __init__(self, cache: torch.Tensor, block_format: BlockFormat) -> None:
        self.cache = cache
        self.block_format = block_format
        self.planes = tuple(block_format.plane_view(cache, plane) for plane in range(block_format.num_planes))
        self.wide_blocks = _wide_blocks(cache, block_format)


class PagedLayers(Sequence[PagedLayer]):
    """Every layer of an engine's paged KV cache, in model order, all of one block format (made once, when the engine
    registers its caches), with the one-launch copy of a request's every layer where it can run.

    Attributes:
        block_format: the layers' common block format.
        request_kernel: the copy of every layer in one launch (``paged_triton.RequestKernel``), or ``None`` (no
            Triton, not CUDA, or a format the kernel does not take): copies then go layer by layer.

    Raises:
        InvalidInputError: no layers, or layers of different block formats.
    """

    def __init__(self, layers: Sequence[PagedLayer]) -> None:
        if not layers:
            raise InvalidInputError("a paged cache needs at least one layer")
        self._layers = tuple(layers)
        self.block_format = self._layers[0].block_format
        if any(layer.block_format != self.block_format for layer in self._layers):
            raise InvalidInputError("every layer of a paged cache must have the same block format")
        key, value = self.block_format.key, self.block_format.value
        # head dims contiguous, K like V; the kernel copies two planes (an MLA latent goes layer by layer)
        fusable = value is not None and all(layer.wide_blocks is not None for layer in self._layers)
        self.request_kernel = (
            RequestKernel.of(
                [layer.cache for layer in self._layers],
                key_offset=key.offset,
                value_offset=value.offset if value is not None else key.offset,
                token_stride=key.token_stride,
                head_stride=key.head_stride,
                num_kv_heads=self.block_format.num_kv_heads,
                block_size=self.block_format.block_size,
                head_dim=self.block_format.head_dim,
            )
            if fusable
            else None
        )

    def check_request_kernel(self, *, block_id: int = 0) -> bool:
        """Compile the one-launch copy now and check it against the per-layer copies on block ``block_id`` of every
        layer, whose bytes it restores (nothing else may touch that block meanwhile: vLLM never hands block 0 to a
        request). Triton compiles at a kernel's first launch, which would otherwise stall the engine's first save and
        first load; and a Triton or GPU that builds it wrong (or not at all) must cost speed, never KV: then
        ``request_kernel`` becomes ``None`` and copies go layer by layer. Returns whether the kernel is kept."""
        kernel = self.request_kernel
        if kernel is None:
            return False
        block_format, device = self.block_format, kernel.first_cache.device
        shape = (
            len(self),
            block_format.num_planes,
            block_format.block_size,
            block_format.num_kv_heads,
            block_format.head_dim,
        )
        ids = torch.full((1,), block_id, dtype=torch.int64, device=device)
        saved = torch.empty(shape, dtype=kernel.first_cache.dtype, device=device)
        _copy_layerwise(self, ids, saved, scatter=False)
        # small integers, exact in every KV dtype, different in every element of a layer and between the two passes
        codes = torch.arange(math.prod(shape), device=device).remainder(251).view(shape).to(saved.dtype)
        try:
            checked = torch.empty_like(saved)
            _copy_layerwise(self, ids, codes, scatter=True)
            kernel.launch(ids, checked, block_format.block_size, scatter=False)
            gathered_right = torch.equal(checked, codes)
            flipped = codes.flip(-1)
            kernel.launch(ids, flipped, block_format.block_size, scatter=True)
            _copy_layerwise(self, ids, checked, scatter=False)
            scattered_right = torch.equal(checked, flipped)
            failure = None if gathered_right and scattered_right else "its copies differ from the per-layer copies"
        except Exception as error:  # a compiler's or driver's error: the per-layer copies still work
            failure = f"{type(error).__name__}: {error}"
        finally:
            _copy_layerwise(self, ids, saved, scatter=True)
        if failure is not None:
            logger.warning("the one-launch KV copy is off (%s); copies go layer by layer", failure)
            self.request_kernel = None
        return failure is None

    @staticmethod
    def of(caches: Sequence[torch.Tensor], block_format: BlockFormat) -> PagedLayers:
        """The layers of ``caches`` (each with dim 0 indexing blocks), all in ``block_format``."""
        return PagedLayers([PagedLayer(cache, block_format) for cache in caches])

    def __len__(self) -> int:
        return len(self._layers)

    @overload
    def __getitem__(self, index: int) -> PagedLayer: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[PagedLayer]: ...

    def __getitem__(self, index: int | slice) -> PagedLayer | Sequence[PagedLayer]:
        return self._layers[index]


class PagedChunk:
    """A chunk of every layer bound to one request's blocks: copied at once after (a save) or before (a load) the
    engine's forward pass (``gather_all`` / ``scatter_all``), or one layer at a time (``gather`` / ``scatter``).

    Every layer at once is one kernel launch where ``PagedLayers.request_kernel`` runs and the chunk is on the
    cache's device: on a GPU a layer of a long prompt copies in tens of microseconds, so a launch per layer leaves
    the device idle between copies and costs the engine's thread a Python call per layer (measured:
    docs/benchmarks.md "Paged KV copies for vLLM"). Elsewhere ``*_all`` goes layer by layer. The checks, the block
    ids of the whole blocks and the 16-byte views of the chunk are made here once per request, so a layer's copy is
    one launch when the format fuses (two, one per plane, when it does not). A chunk that is not on the cache's
    device (a load retrieved into host memory) passes through one layer-sized buffer on the device, made once, so
    each layer is one host-device copy plus the launch.

    Args:
        layers: every layer of the cache (``PagedLayers``).
        block_ids: the blocks in token order, on the cache's device.
        chunk: ``[num_layers, planes, tokens, heads, head_dim]`` (planes: 2, or 1 for MLA). A gather fills its
            ``tokens`` slots from the first blocks (the last one may be partly used); a scatter writes whole blocks
            (``tokens = blocks x block_size``).

    Raises:
        InvalidInputError: the chunk's shape or dtype does not fit the cache, or it needs more blocks than given.
    """

    def __init__(self, layers: PagedLayers, block_ids: torch.Tensor, chunk: torch.Tensor) -> None:
        if chunk.dim() != 5 or chunk.shape[0] != len(layers):
            raise InvalidInputError(
                f"chunk shape {list(chunk.shape)} is not [{len(layers)} layers, 2, tokens, heads, head_dim]"
            )
        first = layers[0]
        block_format = first.block_format
        self._layers = layers
        self._chunk = chunk
        self._block_ids = block_ids
        self._through: torch.Tensor | None = None
        layer_chunks = chunk
        if chunk.device != first.cache.device:
            self._through = torch.empty(chunk.shape[1:], dtype=chunk.dtype, device=first.cache.device)
            layer_chunks = self._through.expand(chunk.shape)  # every layer passes through the same buffer
        self.num_tokens = _check_chunk(first.cache, block_format, block_ids, layer_chunks)
        self._layer_chunks = layer_chunks
        block_size = block_format.block_size
        self._num_full = self.num_tokens // block_size
        self._tail = self.num_tokens - self._num_full * block_size
        # slices only where needed: each is a host-side op before the first launch, which an idle device waits for
        self._full_ids = block_ids if self._num_full == len(block_ids) else block_ids[: self._num_full]
        self._whole_blocks = self.num_tokens == len(block_ids) * block_size
        self._wide_blocks = [layer.wide_blocks for layer in layers if layer.wide_blocks is not None]
        fusable = len(self._wide_blocks) == len(layers)
        self._wide_chunk = _WideChunk.of(layer_chunks, self._num_full, block_format) if fusable else None
        kernel = layers.request_kernel
        one_launch = (
            kernel is not None
            and self._through is None
            and self._wide_chunk is not None  # the chunk 16-byte aligned, as the kernel's loads and stores need
            and block_ids.device == chunk.device  # the kernel reads the ids where it runs
            and block_ids.dtype in (torch.int64, torch.int32)
            and block_ids.is_contiguous()
            and (self.num_tokens < 2 or chunk.stride(2) == block_format.num_kv_heads * block_format.head_dim)
        )
        self._request_kernel = kernel if one_launch else None

    @property
    def fused(self) -> bool:
        """Whether a layer's copy is one call for both planes (16-byte elements), not one per plane."""
        return self._wide_chunk is not None

    @property
    def one_launch(self) -> bool:
        """Whether ``gather_all`` / ``scatter_all`` copy every layer in one kernel launch."""
        return self._request_kernel is not None

    def gather_all(self) -> None:
        """Copy every layer of the blocks into the chunk."""
        if self._request_kernel is not None:
            self._request_kernel.launch(self._block_ids, self._chunk, self.num_tokens, scatter=False)
            return
        for layer in range(len(self._layers)):
            self.gather(layer)

    def scatter_all(self) -> None:
        """Write every layer of the chunk into the blocks.

        Raises:
            InvalidInputError: the chunk does not fill its blocks exactly.
        """
        self._check_whole_blocks()
        if self._request_kernel is not None:
            self._request_kernel.launch(self._block_ids, self._chunk, self.num_tokens, scatter=True)
            return
        for layer in range(len(self._layers)):
            self.scatter(layer)

    def gather(self, layer: int) -> None:
        """Copy layer ``layer`` of the blocks into the chunk."""
        num_full = self._num_full
        if num_full and self._wide_chunk is not None:  # the usual case: one launch and nothing else
            torch.index_select(self._wide_blocks[layer], 0, self._full_ids, out=self._wide_chunk.layer(layer))
        elif num_full:
            paged = self._layers[layer]
            for plane, view in enumerate(paged.planes):
                out = _plane_blocks(self._layer_chunks[layer], plane, num_full, paged.block_format)
                torch.index_select(view, 0, self._full_ids, out=out)
        if self._tail:
            paged, target = self._layers[layer], self._layer_chunks[layer]
            first_tail_token = num_full * paged.block_format.block_size
            tail_ids = self._block_ids[num_full : num_full + 1]  # a view: no device sync to read it
            for plane, view in enumerate(paged.planes):
                target[plane, first_tail_token:].copy_(view.index_select(0, tail_ids)[0, : self._tail])
        if self._through is not None:
            self._chunk[layer].copy_(self._through)  # blocking: the caller reads a host chunk next

    def scatter(self, layer: int) -> None:
        """Write layer ``layer`` of the chunk into the blocks.

        Raises:
            InvalidInputError: the chunk does not fill its blocks exactly.
        """
        self._check_whole_blocks()
        if self._through is not None:
            self._through.copy_(self._chunk[layer], non_blocking=True)
        if self._wide_chunk is not None:  # the usual case: one launch and nothing else
            self._wide_blocks[layer].index_copy_(0, self._block_ids, self._wide_chunk.layer(layer))
            return
        paged, source = self._layers[layer], self._layer_chunks[layer]
        for plane, view in enumerate(paged.planes):
            view.index_copy_(0, self._block_ids, _plane_blocks(source, plane, self._num_full, paged.block_format))

    def _check_whole_blocks(self) -> None:
        if not self._whole_blocks:
            raise InvalidInputError(
                f"a scatter fills whole blocks: {self.num_tokens} tokens for {len(self._block_ids)} blocks of "
                f"{self._layers.block_format.block_size}"
            )


@dataclass(slots=True)
class _WideChunk:
    """A chunk's first whole blocks of one layer as ``[blocks, 2, slots, heads, head_dim / r]`` 16-byte elements,
    made per layer from integers computed once: one ``as_strided`` per call, and no view of every layer built
    before the first layer's launch."""

    wide: torch.Tensor
    size: tuple[int, ...]
    stride: tuple[int, ...]
    first_offset: int
    layer_stride: int

    @staticmethod
    def of(layer_chunks: torch.Tensor, num_blocks: int, block_format: BlockFormat) -> _WideChunk | None:
        """The chunk ``[layers, 2, tokens, heads, head_dim]`` (each token's heads already checked contiguous) in
        16-byte elements, or ``None`` when it is not 16-byte aligned."""
        ratio = _WIDE_DTYPE.itemsize // layer_chunks.element_size()
        layer_stride, plane_stride, chunk_token_stride = layer_chunks.stride()[:3]
        steps = (layer_chunks.storage_offset(), layer_stride, plane_stride, chunk_token_stride)
        if any(step % ratio for step in steps):
            return None
        if layer_chunks.data_ptr() % _WIDE_DTYPE.itemsize:
            return None
        try:
            wide = layer_chunks.view(_WIDE_DTYPE)
        except RuntimeError:
            return None
        slots, heads, wide_dim = block_format.block_size, block_format.num_kv_heads, block_format.head_dim // ratio
        token_stride = chunk_token_stride // ratio
        return _WideChunk(
            wide=wide,
            size=(num_blocks, block_format.num_planes, slots, heads, wide_dim),
            stride=(slots * token_stride, plane_stride // ratio, token_stride, wide_dim, 1),
            first_offset=int(wide.storage_offset()),
            layer_stride=layer_stride // ratio,
        )

    def layer(self, layer: int) -> torch.Tensor:
        return torch.as_strided(
            self.wide, self.size, self.stride, storage_offset=self.first_offset + layer * self.layer_stride
        )


def _copy_layerwise(layers: PagedLayers, block_ids: torch.Tensor, chunk: torch.Tensor, *, scatter: bool) -> None:
    """Every layer of ``chunk`` copied one layer at a time, never through the one-launch kernel."""
    copy = PagedChunk(layers, block_ids, chunk)
    layer_copy = copy.scatter if scatter else copy.gather
    for layer in range(len(layers)):
        layer_copy(layer)


def device_block_ids(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """Block ids as an int64 tensor on ``device``; on a GPU through pinned memory, so the copy queues behind the work
    already on the stream instead of making the caller wait for it (a copy from pageable memory synchronizes)."""
    ids = torch.tensor(block_ids, dtype=torch.int64)
    return ids if device.type == "cpu" else ids.pin_memory().to(device, non_blocking=True)


def gather_blocks(
    layer_cache: torch.Tensor, block_format: BlockFormat, block_ids: torch.Tensor, out: torch.Tensor
) -> None:
    """Fill ``out`` ``[2, tokens, heads, head_dim]`` from the first blocks of ``block_ids`` (a one-off copy of
    one layer; a connector keeps a ``PagedChunk`` per request)."""
    PagedChunk(PagedLayers.of((layer_cache,), block_format), block_ids, out.unsqueeze(0)).gather(0)


def scatter_blocks(
    layer_cache: torch.Tensor, block_format: BlockFormat, block_ids: torch.Tensor, source: torch.Tensor
) -> None:
    """Write ``source`` ``[2, tokens, heads, head_dim]`` into whole blocks ``block_ids`` (a one-off copy of one
    layer)."""
    PagedChunk(PagedLayers.of((layer_cache,), block_format), block_ids, source.unsqueeze(0)).scatter(0)


def _plane_blocks(chunk_layer: torch.Tensor, plane: int, num_blocks: int, block_format: BlockFormat) -> torch.Tensor:
    """The chunk's first ``num_blocks`` blocks of one plane: ``[num_blocks, slots, heads, head_dim]``."""
    shape = (num_blocks, block_format.block_size, block_format.num_kv_heads, block_format.head_dim)
    return chunk_layer[plane, : num_blocks * block_format.block_size].view(shape)


def _wide_blocks(cache: torch.Tensor, block_format: BlockFormat) -> torch.Tensor | None:
    """Both planes of every block, ``[blocks, 2, slots, heads, head_dim / r]`` in 16-byte elements (``[blocks, 1,
    ...]``: an MLA latent); ``None`` when K and V do not share strides, a head's dims are not contiguous, or an offset
    or stride is not 16-byte aligned."""
    key = block_format.key
    value = block_format.value or key  # one plane: its own stride to the next plane is never used
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
        size=(
            cache.shape[0],
            block_format.num_planes,
            block_format.block_size,
            block_format.num_kv_heads,
            block_format.head_dim // ratio,
        ),
        stride=(
            cache.stride(0) // ratio,
            (value.offset - key.offset) // ratio,
            key.token_stride // ratio,
            key.head_stride // ratio,
            1,
        ),
        storage_offset=wide.storage_offset() + key.offset // ratio,
    )


def _check_chunk(
    layer_cache: torch.Tensor, block_format: BlockFormat, block_ids: torch.Tensor, chunk: torch.Tensor
) -> int:
    """The token count of a chunk's layers ``[layers, planes, tokens, heads, head_dim]``, after checking they fit the
    blocks. Every request runs this before its first layer's copy, so it reads shape and strides once and builds
    no views (an idle device waits for it)."""
    heads, head_dim, planes = block_format.num_kv_heads, block_format.head_dim, block_format.num_planes
    shape = chunk.shape[1:]
    if len(shape) != 4 or shape[0] != planes or shape[2] != heads or shape[3] != head_dim:
        raise InvalidInputError(f"chunk layer shape {list(shape)} is not [{planes}, tokens, {heads}, {head_dim}]")
    if chunk.dtype != layer_cache.dtype or chunk.device != layer_cache.device:
        raise InvalidInputError(
            f"chunk layer is {chunk.dtype} on {chunk.device}; the paged cache is {layer_cache.dtype} "
            f"on {layer_cache.device}"
        )
    num_tokens = shape[1]
    _, _, token_stride, head_stride, dim_stride = chunk.stride()
    # each token's [heads, head_dim] contiguous (a stride of a size-1 axis is free); tokens may lie further apart (a
    # part's heads of a whole chunk: a lent view)
    if (
        (head_dim > 1 and dim_stride != 1)
        or (heads > 1 and head_stride != head_dim)
        or (num_tokens > 1 and token_stride < heads * head_dim)
    ):
        raise InvalidInputError("each token of a chunk layer must be contiguous ([heads, head_dim])")
    if num_tokens > len(block_ids) * block_format.block_size:
        raise InvalidInputError(
            f"{num_tokens} tokens do not fit in {len(block_ids)} blocks of {block_format.block_size} slots"
        )
    return int(num_tokens)
