"""``kvstore bench vllm --serve`` run small, end to end, as most users send prompts: text through
``/v1/chat/completions`` (a system message, then the documents joined by blank lines and the question in one user
message), nothing configured on the connector (no separator). Three real vLLM OpenAI servers (vLLM alone, + kvstore,
+ kvstore blending), the real ``openai`` client, the real connector and embedded store.

One run (about three server starts) with an impossible ``--expected-ttft-gain``: it must print every row and then
exit 1 naming the gain; the rows' structure and sanity are checked on its output. Prose documents of 300 tokens and
128-token chunks (vLLM's CPU block): a repeat of a warm-up prompt is an exact hit the store serves. The chat template
tokenizes each prompt whole, so a document's first tokens after a blank line are other ids than after the system
turn; a document is still found in a query by a stored chunk wholly inside it, and the rest of it by slices of that
chunk's stored neighbours (a document shorter than two chunks holds no such chunk: at 150 tokens none was found).
Prose, not the guide's synthetic documents (``"<i> hi hi ..."``): those repeat one another past their first token,
so the blending deployment finds the first one's rows in every later warm-up prompt and blends them instead of
computing them, and a blended prompt is not stored.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvstore.bench.vllm_serve import ROUNDS, ServeRow, ttft_gain_failure
from kvstore.bench.vllm_serve_options import DEFAULT_DEPLOYMENTS

SERVE_TIMEOUT_S = 900.0
"""Three servers (30-90 s each to start here) and a few short requests each."""

# the module's first test pays for the bench run (its fixture): pytest's 300 s default cut it on a slower machine
pytestmark = [pytest.mark.engine_minutes(4.3), pytest.mark.timeout(SERVE_TIMEOUT_S + 60)]


@pytest.fixture(scope="module")
def serve_run(vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess[str]:
    work_dir = tmp_path_factory.mktemp("bench-serve")
    command = [
        str(Path(sys.executable).parent / "kvstore"), "bench", "vllm", "--serve", "--json",
        "--model", str(vllm_model_dir), "--work-dir", str(work_dir), "--corpus", "prose",
        "--documents", "3", "--document-tokens", "300", "--docs-per-query", "3", "--queries", "2",
        "--chat", "--no-connector-separator",
        "--chunk-size", "128", "--max-inflight", "2", "--mixed-requests", "3", "--mixed-max-tokens", "4",
        "--expected-ttft-gain", "1000",
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=SERVE_TIMEOUT_S, check=False)


@pytest.fixture(scope="module")
def rows(serve_run: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in serve_run.stdout.splitlines() if line.startswith("{")]


def test_an_impossible_expected_gain_fails_the_run_after_the_rows(
    serve_run: subprocess.CompletedProcess[str], rows: list[dict[str, Any]]
) -> None:
    assert serve_run.returncode == 1, serve_run.stderr[-3000:]
    assert "below --expected-ttft-gain 1000" in serve_run.stderr
    assert len(rows) == len(DEFAULT_DEPLOYMENTS) * len(ROUNDS)
    parsed = [ServeRow(**(row | {"errors": tuple(row["errors"])})) for row in rows]
    assert ttft_gain_failure(parsed, 0.0) is None, "a gain of 0 is always met"


def test_one_row_per_deployment_and_round_all_requests_served(rows: list[dict[str, Any]]) -> None:
    assert [(row["deployment"], row["round"]) for row in rows] == [(d, r) for d in DEFAULT_DEPLOYMENTS for r in ROUNDS]
    expected_requests = {"warm_up": 3, "query": 2, "mixed": 3}
    for row in rows:
        name = f"{row['deployment']}/{row['round']}"
        assert row["requests"] == expected_requests[row["round"]], name
        assert row["failed"] == 0, f"{name}: {row['errors']}"
        assert 0 < row["ttft_ms_p50"] <= row["ttft_ms_p90"] <= row["ttft_ms_max"], name
        assert row["ttft_ms_mean"] > 0 and row["total_s"] > 0 and row["requests_per_s"] > 0, name
        assert row["prompt_tokens_per_s"] > 0 and row["prompt_tokens_mean"] > 100, name
        assert row["tokens_reused"] + row["tokens_recomputed"] == round(row["prompt_tokens_mean"] * row["requests"])
        assert row["tokens_reused"] >= 0 and row["tokens_recomputed"] > 0, name
        assert (row["itl_ms_p99"] is not None) == (row["max_tokens"] > 1), name
        queue_ms, prefill_ms, engine_ttft_ms = (row[f"engine_{key}_ms_mean"] for key in ("queue", "prefill", "ttft"))
        assert queue_ms >= 0 and 0 < prefill_ms < engine_ttft_ms <= row["ttft_ms_mean"], (name, queue_ms, prefill_ms)
        if row["deployment"] != "vllm":
            assert row["output_mismatches"] == 0, f"{name}: an exact hit's output differs from vLLM alone's"
            assert row["ttft_vs_vllm"] > 0, name
        if row["round"] != "warm_up":
            assert row["ttft_gain"] > 0, name


def test_the_store_serves_what_the_warm_up_cached(rows: list[dict[str, Any]]) -> None:
    by_name = {(row["deployment"], row["round"]): row for row in rows}
    assert by_name[("vllm", "warm_up")]["connector_tokens"] == 0
    for deployment in ("kvstore_prefix", "kvstore_blend"):
        assert by_name[(deployment, "warm_up")]["warm_up_stored"] == 3, f"{deployment}: every warm-up prompt stored"
    assert by_name[("kvstore_prefix", "mixed")]["outputs_compared"] == 3, "every prefix-only request is exact"
    blend_mixed = by_name[("kvstore_blend", "mixed")]
    assert blend_mixed["vllm_cache_hit_tokens"] == 0, "--no-enable-prefix-caching"
    assert blend_mixed["connector_tokens"] >= 128, "the mixed round's exact repeat is loaded from the store"
    assert blend_mixed["outputs_compared"] == 1 and blend_mixed["output_mismatches"] == 0
    query = by_name[("kvstore_blend", "query")]
    assert query["chat"] and not query["chunk_separator"], "text through chat completions, no separator configured"
    # The chat template tokenizes each prompt whole, so a document's first ids after a blank line are not those after
    # the system turn it was cached behind; every document is still found (slices of its stored chunks where the
    # chunk grid and the neighbours differ) and every query blended. vLLM alone reuses only its own prefix hits.
    prompt_tokens = query["prompt_tokens_mean"] * query["requests"]
    assert query["blends"] == 2, query
    assert query["tokens_reused"] >= 0.5 * prompt_tokens, query
    assert query["tokens_reused"] > by_name[("vllm", "query")]["tokens_reused"], query
