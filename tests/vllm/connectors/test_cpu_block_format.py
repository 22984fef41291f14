"""vLLM's real CPU cache-write kernel, probed: the block format kvstore reads is the one the kernel writes.

``WorkerSide`` probes the backend's ``do_kv_cache_update`` at start-up; here the same kernel
(``cpu_attn_reshape_and_cache``) is called directly on synthetic caches, for each ISA this machine can run and
each dtype, and the batched gather/scatter must agree with it element for element.
"""

from __future__ import annotations

import pytest
import torch
from vllm import _custom_ops as vllm_ops

from kvstore.connectors.block_format import probe_block_format
from kvstore.connectors.paged import gather_blocks, scatter_blocks

HEADS, SLOTS, DIM, BLOCKS = 3, 32, 64, 6


def kernel_writer(cache: torch.Tensor, isa: str):
    """The CPU backend's write, exactly as ``CPUAttentionBackendImpl.do_kv_cache_update`` calls it."""

    def write(key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        num_blocks, num_heads, block_size, _ = cache.shape
        key_cache, value_cache = cache.view(num_blocks, num_heads, block_size * 2, -1).chunk(2, dim=2)
        vllm_ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa)

    return write


@pytest.mark.parametrize("isa", ["vec", "vec16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_and_scatter_agree_with_the_cpu_kernel(isa: str, dtype: torch.dtype) -> None:
    cache = torch.zeros(BLOCKS, HEADS, SLOTS, 2 * DIM, dtype=dtype)
    write = kernel_writer(cache, isa)
    block_format = probe_block_format(cache, block_size=SLOTS, num_kv_heads=HEADS, head_dim=DIM, write=write)
    if isa == "vec":  # the layout vLLM documents for its CPU backend: K transposed in each head, then V
        assert (block_format.key.token_stride, block_format.key.dim_stride) == (1, SLOTS)
        assert (block_format.value.offset, block_format.value.token_stride) == (SLOTS * DIM, DIM)

    block_ids = [4, 1, 3]
    num_tokens = 2 * SLOTS + 5
    key, value = torch.randn(2, num_tokens, HEADS, DIM).to(dtype)
    slot_mapping = torch.tensor([block_ids[t // SLOTS] * SLOTS + t % SLOTS for t in range(num_tokens)])
    write(key.contiguous(), value.contiguous(), slot_mapping)
    gathered = torch.empty(2, num_tokens, HEADS, DIM, dtype=dtype)
    gather_blocks(cache, block_format, torch.tensor(block_ids), gathered)
    assert torch.equal(gathered[0], key) and torch.equal(gathered[1], value)

    ours = torch.zeros_like(cache)
    loaded = torch.randn(2, 2 * SLOTS, HEADS, DIM).to(dtype)
    scatter_blocks(ours, block_format, torch.tensor([2, 5]), loaded)
    theirs = torch.zeros_like(cache)
    kernel_writer(theirs, isa)(
        loaded[0].contiguous(),
        loaded[1].contiguous(),
        torch.cat([2 * SLOTS + torch.arange(SLOTS), 5 * SLOTS + torch.arange(SLOTS)]),
    )
    assert torch.equal(ours, theirs)
