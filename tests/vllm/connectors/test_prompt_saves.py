"""A CPU cache's save is gathered off the step's path, and the next step waits for it before its forward.

The first token of a miss used to wait for its prompt's gather (a strided copy of every layer's blocks, 15-35 ms a
1,000-token SmolLM2 prompt on this machine). Now the gather thread copies the blocks after the step has answered, and
``new_step`` (vLLM binding the next step's metadata, before its forward) waits for it: the blocks of a request that
finished may be another request's in that step, and its forward writes them. Real parts: a ``kvstore serve`` on
loopback, real CPU blocks in vLLM's documented packed format, the store's own retrieve to read the save back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from kvstore.client import Client
from kvstore.connectors.group_copies import BoundCopies, GroupCopies
from kvstore.connectors.paged import PagedLayers
from kvstore.connectors.settings import ConnectorSettings
from kvstore.connectors.store_link import StoreLink
from kvstore.connectors.vllm.metadata import SaveSpec
from kvstore.connectors.vllm.parallel import RankPart
from kvstore.connectors.vllm.prompt_saves import PromptSaves
from kvstore.connectors.vllm.worker_side import _packed_format
from kvstore.connectors.vllm.worker_stats import WorkerStats
from tests.server.conftest import SERVER_LAYOUT, running_server

BLOCK_SIZE = 16
NUM_TOKENS = 16 * 24  # 24 chunks of the server's 16 tokens, in 24 of the pool's blocks
POOL_BLOCKS = 64


def _blocks_as_chunk(caches: list[torch.Tensor], block_ids: torch.Tensor) -> torch.Tensor:
    """The prompt's KV read out of packed blocks ``[blocks, heads, slots, K|V]`` by plain indexing."""
    head_dim = SERVER_LAYOUT.head_dim
    layers = []
    for cache in caches:
        blocks = cache[block_ids]  # [n, heads, slots, 2 * head_dim]
        tokens = blocks.permute(0, 2, 1, 3).reshape(-1, SERVER_LAYOUT.num_kv_heads, 2 * head_dim)
        layers.append(torch.stack((tokens[..., :head_dim], tokens[..., head_dim:])))
    return torch.stack(layers)


class _SlowGather(BoundCopies):
    """The real gather, started late: the race with the next step's forward is then certain, not left to timing."""

    def __init__(self, bound: BoundCopies) -> None:
        self._bound = bound

    def gather_all(self) -> None:
        time.sleep(0.3)
        self._bound.gather_all()

    def scatter_all(self) -> None:
        self._bound.scatter_all()


class _SlowGroupCopies(GroupCopies):
    def bind(self, group_block_ids: Sequence[Sequence[int]], chunk: torch.Tensor, *, load: bool) -> BoundCopies:
        return _SlowGather(super().bind(group_block_ids, chunk, load=load))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("producer", [False, True], ids=["engine", "kv_producer"])
def test_a_save_holds_the_blocks_as_its_step_left_them(tmp_path: Path, producer: bool) -> None:
    """An engine's save is gathered after its step (on the gather thread) and the next step waits for it before its
    forward; a prefill engine (``kv_producer``) gathers and stores within the step, its answer meaning "stored"."""
    torch.manual_seed(0)
    dtype = SERVER_LAYOUT.dtype.torch_dtype
    shape = (POOL_BLOCKS, SERVER_LAYOUT.num_kv_heads, BLOCK_SIZE, 2 * SERVER_LAYOUT.head_dim)
    caches = [torch.randn(shape).to(dtype) for _ in range(SERVER_LAYOUT.num_layers)]
    block_ids = torch.randperm(POOL_BLOCKS - 1)[: NUM_TOKENS // BLOCK_SIZE] + 1
    expected = _blocks_as_chunk(caches, block_ids)
    layers = PagedLayers.of(caches, _packed_format(caches[0], BLOCK_SIZE, SERVER_LAYOUT.num_kv_heads,
                                                   SERVER_LAYOUT.head_dim))  # fmt: skip
    tokens = tuple(range(1000, 1000 + NUM_TOKENS))
    spec = SaveSpec(request_id="r", token_ids=tokens, block_ids=tuple(block_ids.tolist()), start=0, end=NUM_TOKENS)
    with running_server(tmp_path / "data") as server:
        link = StoreLink(ConnectorSettings(url=server.url), SERVER_LAYOUT, name="save", timeout_s=30.0)
        copies = _SlowGroupCopies(layers, [0] * len(caches))
        saves = PromptSaves(link, layers, copies, RankPart(part=None, shape=SERVER_LAYOUT), WorkerStats(),
                            wait_for_saves=producer)  # fmt: skip
        try:
            with torch.inference_mode():  # as vLLM runs a step: the staging made in it is an inference tensor
                saves.new_step()
                for layer in range(len(caches)):
                    saves.layer_computed(layer, [spec])
                started = time.perf_counter()
                saves.finish_step()
                step_s = time.perf_counter() - started
            gathering = any(thread.name.startswith("kvstore-gather") for thread in threading.enumerate())
            assert (gathering, step_s < 0.3) == (not producer, not producer), "only a producer's step waits"
            if not producer:
                saves.new_step()  # the next step: its forward may write the blocks of a request that finished
            for cache in caches:
                cache[block_ids] = float("nan")
        finally:
            saves.close()
            link.close()
        with Client(server.url, SERVER_LAYOUT, name="reader", timeout_s=30) as client:
            plan = client.lookup(list(tokens))
            assert plan.num_prefix_tokens == NUM_TOKENS
            result = client.retrieve(plan)
    assert torch.equal(result.kv, expected), "the store holds the blocks as they were when the step ended"
