"""How fast KV moves between vLLM's paged CUDA cache and a kvstore chunk, against a plain device copy.

The connector's save gathers a request's blocks of every layer into a chunk (``PagedChunk.gather``); its load
scatters a chunk back into blocks (``PagedChunk.scatter``), one call per layer. This times both for one request over
all layers, in vLLM 0.32/0.33's packed CUDA format (logical ``[num_blocks, num_kv_heads, block_size, 2*head_dim]``,
K then V on the last axis) in its two physical orders:

- ``LBNHC`` (vLLM's default): memory order ``[num_blocks, block_size, num_kv_heads, 2*head_dim]``;
- ``LBHNC``: the logical order is the memory order.

The block ids are a random sample of a larger pool, so blocks are scattered as in a busy engine. Variants:

- ``current``: ``kvstore.connectors.paged`` as the connector runs it: its ``PagedLayers`` made once (as when
  vLLM registers its caches), a ``PagedChunk`` per request (its checks made inside the timed run), then
  ``gather_all`` / ``scatter_all``: one Triton kernel for every layer where Triton runs (``paged_triton``);
- ``current_layerwise``: the same ``PagedChunk`` copied one layer at a time (what ``*_all`` does without Triton):
  one fused ``index_select`` / ``index_copy_`` per layer on 16-byte elements;
- ``wide16``: the same calls on the same memory reinterpreted as 16-byte elements (``complex128``; the copies are
  bitwise), with the block format's strides divided by 8 -- 8 times fewer index computations per byte;
- ``wide16_fused``: 16-byte elements and both planes in one ``index_select`` / ``index_copy_`` per layer (a
  ``[blocks, 2, slots, heads, head_dim/8]`` view of the cache against the chunk layer viewed the same way), with the
  library's input checks: half the launches of ``wide16``;
- ``whole_block``: one ``index_select`` of whole contiguous blocks (16-byte elements) into a staging tensor, then
  one strided copy that splits K and V (two passes over the bytes);
- ``triton``: a Triton kernel, one program per (block, plane), 16-byte loads (CUDA only, when Triton imports).

Every variant is checked (on its first two layers) before it is timed: the gather (into a NaN-poisoned chunk)
against a chunk built with plain indexing, the scatter against blocks written with plain indexing (untouched blocks
included), bit for bit.

Timing: CUDA events around the whole loop over layers (``time.perf_counter`` on CPU), ``--warmup`` untimed runs,
then ``--repeats`` timed runs; p50/p90/p99/max in ms. GB/s are 10^9 chunk bytes per second, each byte counted once
(memory traffic is twice that: read and write). The baseline, in the same run, is one ``copy_`` of a contiguous
tensor of the chunk's size into another; ``ratio`` is GB/s over the baseline's. ``host_issue_ms`` is the median time
Python takes to issue one run's calls (no sync): near the device time, a run is bound by launches, not bytes.
``current`` and ``current_layerwise`` are also timed as ``eager_prepared``: the ``PagedChunk`` made before the
clock starts, the copy calls alone (in an engine the chunk is bound while the device computes, so its host time
does not leave the device idle; an idle device in this loop waits for it). On CUDA each variant is also timed as
a CUDA graph of the same run (``mode="graph"``), replayed: the device time of the copies alone, as when an engine's
forward pass keeps the GPU busy while Python issues the next layer's copy.

Usage::

    python3 benchmarks/bench_paged_copy.py --json                 # CUDA: Llama-3.1-8B, 15,360 tokens
    .venv/bin/python benchmarks/bench_paged_copy.py --json        # no CUDA: a small shape on CPU

One JSON object per line with ``--json``; else a table. Exit code 1 if a variant's copy is wrong.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from kvstore.connectors.block_format import BlockFormat, PlaneMap
from kvstore.connectors.paged import PagedChunk, PagedLayers, gather_blocks, scatter_blocks

try:
    import triton
    import triton.language as tl
except ImportError:  # the dev machine has no Triton; the H200 image has
    triton = None

TARGET_RATIO = 0.8
"""Issue 30: eager copies (binding included) at >= 0.8x a device-to-device copy of the same bytes."""
VERIFIED_LAYERS = 2
"""Each variant is checked on this many layers (the same calls as every layer's; far less memory than all 32)."""
WIDE_DTYPE = torch.complex128
"""A 16-byte element: copies of it are bitwise loads and stores of 128 bits."""

LAYOUTS = ("LBNHC", "LBHNC")
VARIANTS = ("current", "current_layerwise", "wide16", "wide16_fused", "whole_block", "triton")

CUDA_SHAPE = {"layers": 32, "kv_heads": 8, "head_dim": 128, "block_size": 16, "tokens": 15360, "pool_blocks": 4096}
CPU_SHAPE = {"layers": 4, "kv_heads": 8, "head_dim": 128, "block_size": 16, "tokens": 1024, "pool_blocks": 256}


@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_tokens: int
    num_pool_blocks: int
    dtype: torch.dtype

    @property
    def num_blocks(self) -> int:
        return self.num_tokens // self.block_size


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    op: str
    layout: str
    variant: str
    mode: str
    device: str
    dtype: str
    num_layers: int
    num_tokens: int
    num_pool_blocks: int
    payload_bytes: int
    GBps: float
    baseline: str
    baseline_GBps: float
    ratio: float
    target_ratio: float
    met: bool
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    host_issue_ms: float
    num_repeats: int
    verified: bool


LayerCopy = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
"""``copy(layer_cache, block_ids, chunk_layer)``: a gather (blocks -> chunk layer) or a scatter (the reverse)."""

RequestCopy = Callable[[list[torch.Tensor], torch.Tensor, torch.Tensor], None]
"""``copy(layer_caches, block_ids, chunk)``: one request's gather or scatter of every layer, one layer at a time."""


def layer_by_layer(copy: LayerCopy) -> RequestCopy:
    """A request's copy as one call of ``copy`` per layer."""

    def run(caches: list[torch.Tensor], ids: torch.Tensor, chunk: torch.Tensor) -> None:
        for layer, cache in enumerate(caches):
            copy(cache, ids, chunk[layer])

    return run


def make_layer_cache(shape: Shape, layout: str, device: torch.device) -> torch.Tensor:
    """A layer of random KV with logical shape ``[pool_blocks, heads, block_size, 2*head_dim]``."""
    blocks, heads, slots, width = shape.num_pool_blocks, shape.num_kv_heads, shape.block_size, 2 * shape.head_dim
    if layout == "LBNHC":
        return torch.randn(blocks, slots, heads, width, dtype=shape.dtype, device=device).permute(0, 2, 1, 3)
    return torch.randn(blocks, heads, slots, width, dtype=shape.dtype, device=device)


def packed_format(cache: torch.Tensor, block_size: int, num_kv_heads: int, head_dim: int) -> BlockFormat:
    """The connector's format for vLLM's CUDA cache without a probe (``worker_side._packed_format``, copied here
    because that module imports vLLM)."""
    _, head_stride, token_stride, dim_stride = cache.stride()
    key = PlaneMap(offset=0, token_stride=token_stride, head_stride=head_stride, dim_stride=dim_stride)
    value = PlaneMap(
        offset=head_dim * dim_stride, token_stride=token_stride, head_stride=head_stride, dim_stride=dim_stride
    )
    return BlockFormat(block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim, key=key, value=value)


def widen(block_format: BlockFormat, element_bytes: int) -> BlockFormat:
    """The same format in 16-byte elements (needs contiguous head_dim rows of a multiple of 16 bytes)."""
    ratio = WIDE_DTYPE.itemsize // element_bytes

    def scale(plane: PlaneMap) -> PlaneMap:
        assert plane.dim_stride == 1 and plane.offset % ratio == 0, "widen() needs contiguous head_dim rows"
        return PlaneMap(
            offset=plane.offset // ratio,
            token_stride=plane.token_stride // ratio,
            head_stride=plane.head_stride // ratio,
            dim_stride=1,
        )

    return BlockFormat(
        block_size=block_format.block_size,
        num_kv_heads=block_format.num_kv_heads,
        head_dim=block_format.head_dim // ratio,
        key=scale(block_format.key),
        value=scale(block_format.value),
    )


def variant_copies(name: str, shape: Shape, block_format: BlockFormat) -> tuple[RequestCopy, RequestCopy]:
    """(gather, scatter) of a request for variant ``name``."""
    if name in ("current", "current_layerwise"):
        return connector_copies(block_format, layerwise=name == "current_layerwise")
    gather, scatter = layer_copies(name, shape, block_format)
    return layer_by_layer(gather), layer_by_layer(scatter)


def connector_copies(block_format: BlockFormat, *, layerwise: bool) -> tuple[RequestCopy, RequestCopy]:
    """What the connector runs: its ``PagedLayers`` made once, when the engine registers its layer tensors, then per
    request one ``PagedChunk`` (made inside the timed run) and ``gather_all`` / ``scatter_all``; with ``layerwise``,
    one call per layer instead (what ``*_all`` does where the one-launch kernel cannot run)."""
    registered: dict[int, tuple[list[torch.Tensor], PagedLayers]] = {}

    def request_copy(caches: list[torch.Tensor], ids: torch.Tensor, chunk: torch.Tensor) -> PagedChunk:
        if id(caches) not in registered:  # the list is kept, so its id is not reused while registered
            registered[id(caches)] = (caches, PagedLayers.of(caches, block_format))
        return PagedChunk(registered[id(caches)][1], ids, chunk)

    def gather(caches: list[torch.Tensor], ids: torch.Tensor, chunk: torch.Tensor) -> None:
        copy = request_copy(caches, ids, chunk)
        if not layerwise:
            copy.gather_all()
            return
        for layer in range(len(caches)):
            copy.gather(layer)

    def scatter(caches: list[torch.Tensor], ids: torch.Tensor, chunk: torch.Tensor) -> None:
        copy = request_copy(caches, ids, chunk)
        if not layerwise:
            copy.scatter_all()
            return
        for layer in range(len(caches)):
            copy.scatter(layer)

    return gather, scatter


def prepared_copies(
    caches: list[torch.Tensor],
    ids: torch.Tensor,
    chunk: torch.Tensor,
    block_format: BlockFormat,
    op: str,
    *,
    layerwise: bool,
) -> Callable[[], None]:
    """The connector's copy calls alone, its ``PagedChunk`` made beforehand (in an engine a chunk can be bound while
    the device runs the forward pass)."""
    copy = PagedChunk(PagedLayers.of(caches, block_format), ids, chunk)
    if not layerwise:
        return copy.gather_all if op == "gather" else copy.scatter_all
    layer_copy = copy.gather if op == "gather" else copy.scatter

    def run() -> None:
        for layer in range(len(caches)):
            layer_copy(layer)

    return run


def layer_copies(name: str, shape: Shape, block_format: BlockFormat) -> tuple[LayerCopy, LayerCopy]:
    """(gather, scatter) of one layer for the exploratory variant ``name``."""
    wide_format = widen(block_format, shape.dtype.itemsize)
    if name == "wide16":
        return (
            lambda cache, ids, out: gather_blocks(cache.view(WIDE_DTYPE), wide_format, ids, out.view(WIDE_DTYPE)),
            lambda cache, ids, source: scatter_blocks(
                cache.view(WIDE_DTYPE), wide_format, ids, source.view(WIDE_DTYPE)
            ),
        )
    if name == "wide16_fused":
        return fused_copies(wide_format)
    if name == "whole_block":
        return whole_block_copies(shape, wide_format)
    if name == "triton":
        return triton_copies(block_format)
    raise ValueError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")


def fused_copies(wide_format: BlockFormat) -> tuple[LayerCopy, LayerCopy]:
    """Both planes in one call per layer, on 16-byte elements (needs K and V to share slot and head strides)."""
    key, value = wide_format.key, wide_format.value
    assert (key.token_stride, key.head_stride) == (value.token_stride, value.head_stride)
    block_shape = (wide_format.block_size, wide_format.num_kv_heads, wide_format.head_dim)
    plane_shape = (wide_format.num_kv_heads, wide_format.head_dim * WIDE_DTYPE.itemsize)

    def blocks(cache: torch.Tensor) -> torch.Tensor:
        wide = cache.view(WIDE_DTYPE)
        return torch.as_strided(
            wide,
            (wide.shape[0], 2, *block_shape),
            (wide.stride(0), value.offset - key.offset, key.token_stride, key.head_stride, 1),
            wide.storage_offset() + key.offset,
        )

    def chunk_blocks(cache: torch.Tensor, ids: torch.Tensor, chunk_layer: torch.Tensor) -> torch.Tensor:
        # the checks gather_blocks / scatter_blocks make, so that the host cost compares
        num_tokens = len(ids) * wide_format.block_size
        if chunk_layer.dim() != 4 or chunk_layer.shape[0] != 2 or chunk_layer.shape[1] != num_tokens:
            raise ValueError(f"chunk layer shape {list(chunk_layer.shape)} is not [2, {num_tokens}, heads, head_dim]")
        if chunk_layer.dtype != cache.dtype or chunk_layer.device != cache.device or not chunk_layer.is_contiguous():
            raise ValueError("the chunk layer must be contiguous, of the cache's dtype and device")
        if (chunk_layer.shape[2], chunk_layer.shape[3] * chunk_layer.element_size()) != plane_shape:
            raise ValueError(f"chunk layer shape {list(chunk_layer.shape)} does not fit the block format")
        return chunk_layer.view(WIDE_DTYPE).view(2, len(ids), *block_shape).transpose(0, 1)

    def gather(cache: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
        torch.index_select(blocks(cache), 0, ids, out=chunk_blocks(cache, ids, out))

    def scatter(cache: torch.Tensor, ids: torch.Tensor, source: torch.Tensor) -> None:
        blocks(cache).index_copy_(0, ids, chunk_blocks(cache, ids, source))

    return gather, scatter


def whole_block_copies(shape: Shape, wide_format: BlockFormat) -> tuple[LayerCopy, LayerCopy]:
    """Whole blocks through a staging tensor: rows of ``block_elements`` 16-byte elements, then a K/V split."""
    key, value = wide_format.key, wide_format.value
    assert key.offset == 0 and (key.token_stride, key.head_stride) == (value.token_stride, value.head_stride)
    block_elements = shape.block_size * shape.num_kv_heads * wide_format.head_dim * 2
    staging: list[torch.Tensor] = []  # one buffer, grown on demand

    def rows_and_planes(cache: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        wide = cache.view(WIDE_DTYPE)
        assert wide.stride(0) == block_elements, "whole_block needs each block to be one contiguous run"
        rows = torch.as_strided(wide, (wide.shape[0], block_elements), (block_elements, 1), wide.storage_offset())
        if not staging or staging[0].numel() < num_blocks * block_elements:
            staging[:] = [torch.empty(num_blocks * block_elements, dtype=WIDE_DTYPE, device=cache.device)]
        picked = staging[0][: num_blocks * block_elements].view(num_blocks, block_elements)
        planes = torch.as_strided(
            picked,
            (2, num_blocks, shape.block_size, shape.num_kv_heads, wide_format.head_dim),
            (value.offset, block_elements, key.token_stride, key.head_stride, 1),
        )
        return rows, picked, planes

    def chunk_planes(chunk_layer: torch.Tensor, num_blocks: int) -> torch.Tensor:
        return chunk_layer.view(WIDE_DTYPE).view(
            2, num_blocks, shape.block_size, shape.num_kv_heads, wide_format.head_dim
        )

    def gather(cache: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
        rows, picked, planes = rows_and_planes(cache, len(ids))
        torch.index_select(rows, 0, ids, out=picked)
        chunk_planes(out, len(ids)).copy_(planes)

    def scatter(cache: torch.Tensor, ids: torch.Tensor, source: torch.Tensor) -> None:
        rows, picked, planes = rows_and_planes(cache, len(ids))
        planes.copy_(chunk_planes(source, len(ids)))
        rows.index_copy_(0, ids, picked)

    return gather, scatter


if triton is not None:

    @triton.jit
    def _block_copy_kernel(
        cache_ptr,
        ids_ptr,
        chunk_ptr,
        block_stride,
        value_offset,
        token_stride,
        head_stride,
        chunk_plane_stride,
        NUM_HEADS: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        ROWS: tl.constexpr,
        SCATTER: tl.constexpr,
    ):
        """Program (i, plane) copies plane ``plane`` of block ``ids[i]`` to/from chunk tokens
        ``[i*BLOCK_SIZE, (i+1)*BLOCK_SIZE)``: (slot, head) rows of HEAD_DIM contiguous elements."""
        index = tl.program_id(0)
        plane = tl.program_id(1)
        block_id = tl.load(ids_ptr + index).to(tl.int64)
        cache_base = cache_ptr + block_id * block_stride + plane * value_offset
        chunk_base = (
            chunk_ptr
            + plane.to(tl.int64) * chunk_plane_stride
            + index.to(tl.int64) * (BLOCK_SIZE * NUM_HEADS * HEAD_DIM)
        )
        columns = tl.arange(0, HEAD_DIM)
        for first_row in tl.static_range(0, BLOCK_SIZE * NUM_HEADS, ROWS):
            rows = first_row + tl.arange(0, ROWS)
            slots = rows // NUM_HEADS
            heads = rows % NUM_HEADS
            cache_at = cache_base + (slots * token_stride + heads * head_stride)[:, None] + columns[None, :]
            chunk_at = chunk_base + rows[:, None] * HEAD_DIM + columns[None, :]
            if SCATTER:
                tl.store(cache_at, tl.load(chunk_at))
            else:
                tl.store(chunk_at, tl.load(cache_at))


def triton_copies(block_format: BlockFormat) -> tuple[LayerCopy, LayerCopy]:
    key, value = block_format.key, block_format.value
    assert key.offset == 0 and key.dim_stride == value.dim_stride == 1
    assert (key.token_stride, key.head_stride) == (value.token_stride, value.head_stride)
    rows_per_step = min(32, block_format.block_size * block_format.num_kv_heads)

    def launch(cache: torch.Tensor, ids: torch.Tensor, chunk_layer: torch.Tensor, scatter: bool) -> None:
        _block_copy_kernel[(len(ids), 2)](
            cache,
            ids,
            chunk_layer,
            cache.stride(0),
            value.offset,
            key.token_stride,
            key.head_stride,
            chunk_layer.stride(0),
            NUM_HEADS=block_format.num_kv_heads,
            BLOCK_SIZE=block_format.block_size,
            HEAD_DIM=block_format.head_dim,
            ROWS=rows_per_step,
            SCATTER=scatter,
            num_warps=4,
        )

    return (
        lambda cache, ids, out: launch(cache, ids, out, False),
        lambda cache, ids, source: launch(cache, ids, source, True),
    )


def reference_gather(cache: torch.Tensor, ids: torch.Tensor, shape: Shape) -> torch.Tensor:
    """Plain indexing: the chunk layer ``[2, tokens, heads, head_dim]`` of blocks ``ids``."""
    picked = cache[ids]  # [blocks, heads, slots, 2*head_dim]
    planes = [picked[..., : shape.head_dim], picked[..., shape.head_dim :]]
    return torch.stack([plane.permute(0, 2, 1, 3).reshape(-1, shape.num_kv_heads, shape.head_dim) for plane in planes])


def reference_scatter(cache: torch.Tensor, ids: torch.Tensor, source: torch.Tensor, shape: Shape) -> None:
    blocks = source.view(2, len(ids), shape.block_size, shape.num_kv_heads, shape.head_dim).permute(0, 1, 3, 2, 4)
    cache[ids, :, :, : shape.head_dim] = blocks[0]
    cache[ids, :, :, shape.head_dim :] = blocks[1]


def verify(
    shape: Shape, caches: list[torch.Tensor], ids: torch.Tensor, gather: RequestCopy, scatter: RequestCopy
) -> bool:
    device = caches[0].device
    chunk = torch.full(
        (len(caches), 2, shape.num_tokens, shape.num_kv_heads, shape.head_dim),
        math.nan,
        dtype=shape.dtype,
        device=device,
    )
    gather(caches, ids, chunk)
    if not all(torch.equal(chunk[layer], reference_gather(cache, ids, shape)) for layer, cache in enumerate(caches)):
        return False
    source = torch.randn_like(chunk)
    expected = [cache.clone() for cache in caches]
    for layer, cache in enumerate(expected):
        reference_scatter(cache, ids, source[layer], shape)
    scatter(caches, ids, source)
    return all(torch.equal(cache, want) for cache, want in zip(caches, expected, strict=True))


def time_runs(run: Callable[[], None], device: torch.device, warmup: int, repeats: int) -> tuple[list[float], float]:
    """Per-run milliseconds and the median host time to issue one run."""
    for _ in range(warmup):
        run()
    times_ms, issue_ms = [], []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            issued_s = time.perf_counter()
            start.record()
            run()
            end.record()
            issue_ms.append((time.perf_counter() - issued_s) * 1e3)
            end.synchronize()
            times_ms.append(start.elapsed_time(end))
        else:
            started_s = time.perf_counter()
            run()
            times_ms.append((time.perf_counter() - started_s) * 1e3)
            issue_ms.append(times_ms[-1])
    return times_ms, statistics.median(issue_ms)


def significant(value: float) -> float:
    """``value`` to 4 significant digits."""
    return float(f"{value:.4g}")


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(fraction * len(ordered)) - 1)]


def print_kernels(title: str, run: Callable[[], None]) -> None:
    """The kernels one run launches, with their device time, on stderr."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        run()
        torch.cuda.synchronize()
    table = profile.key_averages().table(sort_by="device_time_total", row_limit=6, max_name_column_width=90)
    print(f"== {title}\n{table}", file=sys.stderr, flush=True)


def time_baseline(chunk: torch.Tensor, args: argparse.Namespace) -> list[float]:
    """Per-run milliseconds of one contiguous ``copy_`` of ``chunk``'s bytes into another tensor."""
    source, target = torch.randn_like(chunk).view(-1), torch.empty_like(chunk).view(-1)
    times_ms, _ = time_runs(lambda: target.copy_(source), chunk.device, args.warmup, args.repeats)
    return times_ms


def measure_layout(
    shape: Shape, layout: str, variants: list[str], device: torch.device, args: argparse.Namespace
) -> list[Row]:
    caches = [make_layer_cache(shape, layout, device) for _ in range(shape.num_layers)]
    block_format = packed_format(caches[0], shape.block_size, shape.num_kv_heads, shape.head_dim)
    generator = torch.Generator().manual_seed(args.seed)
    ids = (torch.randperm(shape.num_pool_blocks - 1, generator=generator)[: shape.num_blocks] + 1).to(device)
    chunk = torch.randn(
        shape.num_layers, 2, shape.num_tokens, shape.num_kv_heads, shape.head_dim, dtype=shape.dtype, device=device
    )
    payload_bytes = chunk.numel() * chunk.element_size()

    baseline_ms = time_baseline(chunk, args)
    baseline_GBps = payload_bytes / statistics.median(baseline_ms) / 1e6
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"

    def row(op: str, variant: str, mode: str, times_ms: list[float], issue_ms: float, verified: bool) -> Row:
        GBps = payload_bytes / statistics.median(times_ms) / 1e6
        ratio = GBps / baseline_GBps
        return Row(
            op=op,
            layout=layout,
            variant=variant,
            mode=mode,
            device=device_name,
            dtype=str(shape.dtype).removeprefix("torch."),
            num_layers=shape.num_layers,
            num_tokens=shape.num_tokens,
            num_pool_blocks=shape.num_pool_blocks,
            payload_bytes=payload_bytes,
            GBps=significant(GBps),
            baseline="device-to-device copy_ of the same bytes (contiguous)",
            baseline_GBps=significant(baseline_GBps),
            ratio=significant(ratio),
            target_ratio=TARGET_RATIO,
            met=verified and ratio >= TARGET_RATIO,
            p50_ms=round(statistics.median(times_ms), 4),
            p90_ms=round(percentile(times_ms, 0.9), 4),
            p99_ms=round(percentile(times_ms, 0.99), 4),
            max_ms=round(max(times_ms), 4),
            host_issue_ms=round(issue_ms, 4),
            num_repeats=len(times_ms),
            verified=verified,
        )

    rows = [row("copy", "baseline", "eager", baseline_ms, 0.0, True)]
    for variant in variants:
        gather, scatter = variant_copies(variant, shape, block_format)
        verified = verify(shape, caches[:VERIFIED_LAYERS], ids, gather, scatter)

        def gather_all(gather: RequestCopy = gather) -> None:
            gather(caches, ids, chunk)

        def scatter_all(scatter: RequestCopy = scatter) -> None:
            scatter(caches, ids, chunk)

        for op, run in (("gather", gather_all), ("scatter", scatter_all)):
            times_ms, issue_ms = time_runs(run, device, args.warmup, args.repeats)
            rows.append(row(op, variant, "eager", times_ms, issue_ms, verified))
            if variant.startswith("current"):
                prepared = prepared_copies(
                    caches, ids, chunk, block_format, op, layerwise=variant == "current_layerwise"
                )
                times_ms, issue_ms = time_runs(prepared, device, args.warmup, args.repeats)
                rows.append(row(op, variant, "eager_prepared", times_ms, issue_ms, verified))
            if args.profile and device.type == "cuda":
                print_kernels(f"{layout} {variant} {op}", run)
            if device.type == "cuda" and not args.no_graphs:
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(graph):
                        run()
                except RuntimeError as error:  # a kernel that syncs cannot be captured: report, go on
                    print(f"{layout} {variant} {op}: no graph row ({error})", file=sys.stderr, flush=True)
                    continue
                times_ms, issue_ms = time_runs(graph.replay, device, args.warmup, args.repeats)
                rows.append(row(op, variant, "graph", times_ms, issue_ms, verified))
                del graph
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--layers", type=int, help="default 32 on CUDA, 4 on CPU")
    parser.add_argument("--kv-heads", type=int, help="default 8")
    parser.add_argument("--head-dim", type=int, help="default 128")
    parser.add_argument("--block-size", type=int, help="token slots per block; default 16")
    parser.add_argument("--tokens", type=int, help="request length; default 15360 on CUDA, 1024 on CPU")
    parser.add_argument("--pool-blocks", type=int, help="blocks per layer; default 4096 on CUDA, 256 on CPU")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--variants", help=f"comma-separated, of {', '.join(VARIANTS)}; default all that can run")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-graphs", action="store_true", help="CUDA: skip the graph-replay timings")
    parser.add_argument("--profile", action="store_true", help="CUDA: list each variant's kernels on stderr")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    return parser.parse_args(argv)


def resolve_shape(args: argparse.Namespace, device: torch.device) -> Shape:
    defaults = CUDA_SHAPE if device.type == "cuda" else CPU_SHAPE
    values = {name: getattr(args, name) or default for name, default in defaults.items()}
    shape = Shape(
        num_layers=values["layers"],
        num_kv_heads=values["kv_heads"],
        head_dim=values["head_dim"],
        block_size=values["block_size"],
        num_tokens=values["tokens"],
        num_pool_blocks=values["pool_blocks"],
        dtype=getattr(torch, args.dtype),
    )
    if shape.num_tokens % shape.block_size or shape.num_blocks >= shape.num_pool_blocks:
        raise SystemExit(
            f"--tokens {shape.num_tokens} must be a multiple of --block-size {shape.block_size} and need fewer "
            f"blocks than --pool-blocks {shape.num_pool_blocks} (block 0 is never used)"
        )
    return shape


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if use_cuda else "cpu")
    shape = resolve_shape(args, device)
    wide_ok = (shape.head_dim * shape.dtype.itemsize) % WIDE_DTYPE.itemsize == 0
    if args.variants:
        variants = args.variants.split(",")
    else:
        variants = [
            name
            for name in VARIANTS
            if name.startswith("current") or (wide_ok and (name != "triton" or (triton is not None and use_cuda)))
        ]
    rows: list[Row] = []
    for layout in args.layouts.split(","):
        for row in measure_layout(shape, layout, variants, device, args):
            rows.append(row)
            if args.json:
                print(json.dumps(asdict(row)), flush=True)
        if use_cuda:
            torch.cuda.empty_cache()
    if not args.json:
        print(
            f"{'layout':7} {'variant':12} {'mode':6} {'op':8} {'GB/s':>8} {'ratio':>6} {'p50 ms':>8} {'issue ms':>8} ok"
        )
        for row in rows:
            print(
                f"{row.layout:7} {row.variant:12} {row.mode:6} {row.op:8} {row.GBps:8.1f} {row.ratio:6.3f} "
                f"{row.p50_ms:8.3f} {row.host_issue_ms:8.3f} {'yes' if row.verified else 'NO'}"
            )
    return 0 if all(row.verified for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
