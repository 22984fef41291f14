"""Attention of a scattered subset of queries, causal by absolute position: both kernels against a dense reference
(every score computed, masked, softmaxed in float64), grouped-query heads, a short query set (padded to a whole
flex block) and a long one."""

from __future__ import annotations

import pytest
import torch

from kvstore.blend.layerwise import BlendConfig
from kvstore.blend.query_attention import AttentionKernel, QueryMask
from kvstore.errors import ConfigError

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def dense_reference(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    groups = query.shape[1] // keys.shape[1]
    keys64 = keys.double().repeat_interleave(groups, dim=1)
    values64 = values.double().repeat_interleave(groups, dim=1)
    scores = query.double() @ keys64.transpose(-1, -2) * HEAD_DIM**-0.5
    allowed = torch.arange(keys.shape[2])[None, :] <= positions[:, None]
    return (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ values64).float()


def scattered(num_queries: int, num_keys: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(num_keys - 1, generator=generator)[: num_queries - 1]
    return torch.cat([chosen.sort().values, torch.tensor([num_keys - 1])])  # the last token is always a query


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the cpu twin runs everywhere)")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])])
@pytest.mark.parametrize("kernel", [AttentionKernel.SDPA, AttentionKernel.FLEX])
@pytest.mark.parametrize("num_queries", [40, 529, 1400])  # on the CPU sdpa: 1, 4 and 10 row groups
def test_each_kernel_matches_the_dense_reference(kernel: AttentionKernel, num_queries: int, device: str) -> None:
    """On CUDA flex attention is the compiled kernel (on the CPU its uncompiled reference)."""
    num_keys = 1500
    generator = torch.Generator().manual_seed(num_queries)
    positions = scattered(num_queries, num_keys, seed=num_queries)
    query = torch.randn(1, HEADS, num_queries, HEAD_DIM, generator=generator)
    keys = torch.randn(1, KV_HEADS, num_keys, HEAD_DIM, generator=generator)
    values = torch.randn(1, KV_HEADS, num_keys, HEAD_DIM, generator=generator)
    mask = QueryMask(positions.to(device), num_keys, torch.float32, kernel)
    assert not mask.causal and mask.kernel is kernel
    out = mask.attend(
        query.to(device), keys.to(device), values.to(device), scale=HEAD_DIM**-0.5, kv_groups=HEADS // KV_HEADS
    )
    tolerance = 2e-5 if device == "cpu" else 2e-3  # TF32 and kernel accumulation order on the GPU
    expected = dense_reference(query, keys, values, positions)
    torch.testing.assert_close(out.cpu(), expected, atol=tolerance, rtol=tolerance)


def test_every_position_in_order_is_plain_causal_attention() -> None:
    num_keys = 64
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(1, HEADS, num_keys, HEAD_DIM, generator=generator)
    keys = torch.randn(1, KV_HEADS, num_keys, HEAD_DIM, generator=generator)
    values = torch.randn(1, KV_HEADS, num_keys, HEAD_DIM, generator=generator)
    mask = QueryMask(torch.arange(num_keys), num_keys, torch.float32, AttentionKernel.FLEX)
    assert mask.causal
    out = mask.attend(query, keys, values, scale=HEAD_DIM**-0.5, kv_groups=2)
    torch.testing.assert_close(out, dense_reference(query, keys, values, torch.arange(num_keys)), atol=2e-5, rtol=2e-5)


def test_auto_is_flex_on_cuda_and_sdpa_elsewhere() -> None:
    assert AttentionKernel.AUTO.resolve(torch.device("cpu")) is AttentionKernel.SDPA
    assert AttentionKernel.AUTO.resolve(torch.device("cuda", 0)) is AttentionKernel.FLEX
    assert AttentionKernel.SDPA.resolve(torch.device("cuda", 0)) is AttentionKernel.SDPA


def test_an_unknown_kernel_is_a_clear_config_error() -> None:
    assert BlendConfig(attention="sdpa").attention is AttentionKernel.SDPA  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="attention='fast' is not one of auto, sdpa, flex"):
        BlendConfig(attention="fast")  # type: ignore[arg-type]


@pytest.mark.parametrize("num_queries", [1, 40, 529])
def test_the_flex_block_mask_lists_exactly_the_key_blocks_each_query_block_needs(num_queries: int) -> None:
    """The compiled kernel skips every key block a query block does not list and unmasks every block listed as
    full, so the lists must match the causal-by-position pattern block for block (the CPU reference evaluates the
    mask everywhere and would not notice)."""
    num_keys, block = 1500, 128
    positions = scattered(num_queries, num_keys, seed=num_queries)
    mask = QueryMask(positions, num_keys, torch.float32, AttentionKernel.FLEX)
    padded = torch.cat([positions, positions[-1:].expand(-num_queries % block)])
    allowed = torch.arange(num_keys)[None, :] <= padded[:, None]
    num_key_blocks = -(-num_keys // block)
    allowed = torch.nn.functional.pad(allowed, (0, num_key_blocks * block - num_keys))
    per_block = allowed.view(-1, block, num_key_blocks, block)
    any_allowed, all_allowed = per_block.any(dim=(1, 3)), per_block.all(dim=(1, 3))
    block_mask = mask._block_mask
    full = torch.zeros_like(any_allowed)
    for query_block, count in enumerate(block_mask.full_kv_num_blocks[0, 0].tolist()):
        full[query_block, block_mask.full_kv_indices[0, 0, query_block, :count].long()] = True
    listed = block_mask.to_dense()[0, 0].bool()
    assert torch.equal(listed, any_allowed), "a listed block must hold some allowed key, and every such block is listed"
    assert bool((all_allowed[full]).all()), "a block marked full must be allowed for every query of its block"
