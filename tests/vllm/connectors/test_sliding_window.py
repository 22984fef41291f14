"""Sliding-window models through kvstore's connector: what the connector declares to vLLM and which KV cache groups
it serves.

Engines of a sliding-window model (a four-layer random Gemma 3, vLLM's hybrid KV cache manager kept on) at TP=1,
TP=2, PP=2 and with one KV cache group load each other's KV in tests/vllm/connectors/test_parallel_shapes.py, whose
engines check tensor and pipeline parallelism on that model (one set of engines for both).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma
from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec

from kvstore.connectors.vllm import KVStoreConnector
from kvstore.connectors.vllm.engine_facts import check_engine_supported
from kvstore.connectors.vllm.kv_groups import KVGroup, KVGroups, check_groups_compose
from kvstore.errors import ConfigError


def test_the_connector_is_hma_and_serves_full_attention_and_sliding_window_groups_only() -> None:
    """vLLM reads ``SupportsHMA`` from the class before building the connector, and keeps its hybrid manager on;
    any group kind the connector does not copy (chunked local attention here) is refused in one line naming the
    flag that turns the hybrid manager off."""
    assert supports_hma(KVStoreConnector)
    common = {"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float32}
    engine = SimpleNamespace(cache_config=SimpleNamespace(cache_dtype="auto", block_size=16))
    served = SimpleNamespace(
        kv_cache_groups=[
            SimpleNamespace(layer_names=["a"], kv_cache_spec=SlidingWindowSpec(sliding_window=64, **common)),
            SimpleNamespace(layer_names=["b"], kv_cache_spec=FullAttentionSpec(**common)),
        ]
    )
    check_engine_supported(engine, served)  # type: ignore[arg-type]
    local = SimpleNamespace(
        kv_cache_groups=[
            SimpleNamespace(
                layer_names=["a"], kv_cache_spec=ChunkedLocalAttentionSpec(attention_chunk_size=64, **common)
            )
        ]
    )
    with pytest.raises(ConfigError, match=r"ChunkedLocalAttentionSpec .*--disable-hybrid-kv-cache-manager"):
        check_engine_supported(engine, local)  # type: ignore[arg-type]


def test_blending_with_several_kv_cache_groups_is_refused_in_one_line() -> None:
    """A blend pass writes one block table; tensor and pipeline parallelism compose with any groups (every worker
    has the engine's groups: the engines above), so nothing else about groups is refused."""
    groups = KVGroups(groups=(KVGroup(("a",), sliding_window=64), KVGroup(("b",))), block_size=16)
    with pytest.raises(ConfigError, match=r"kvstore.blend writes one block table .* 2 KV cache groups") as refused:
        check_groups_compose(groups, blend=True)
    assert "\n" not in str(refused.value)
    check_groups_compose(groups, blend=False)
    check_groups_compose(KVGroups(groups=(KVGroup(("a", "b")),), block_size=16), blend=True)
