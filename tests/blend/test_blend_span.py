"""``run_blend_pass`` over the first tokens of a prompt only (``span_end``) and without logits: what an engine that
computes the rest of the prompt itself (vLLM, through kvstore's blend engine) asks of the pass."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstore.blend import BlendConfig, LayerwiseBlender
from kvstore.blend.layerwise import BlendPassResult, run_blend_pass
from kvstore.errors import ConfigError
from kvstore.keys import as_token_array
from kvstore.models import RandomInitModel
from tests.blend.test_blender import documents, multi_doc_prompt, open_store, warm


@pytest.fixture
def blender(tiny_llama: RandomInitModel, tmp_path: Path) -> Iterator[LayerwiseBlender]:
    with open_store(tiny_llama.layout, tmp_path) as store, LayerwiseBlender(tiny_llama.model, store) as blender:
        yield blender


def span_pass(
    blender: LayerwiseBlender, prompt: list[int], end: int, settings: float | BlendConfig
) -> BlendPassResult:
    with blender.store.session() as session, torch.inference_mode():
        return run_blend_pass(
            stack=blender._stack,  # the pieces a vLLM engine builds for itself
            rotator=blender._rotator,
            loader=blender._loader,
            owner=session,
            layout=blender.layout,
            tokens=as_token_array(prompt),
            settings=settings if isinstance(settings, BlendConfig) else BlendConfig(recompute_ratio=settings),
            clock=blender._clock,
            costs=blender.load_costs,
            span_end=end,
            need_logits=False,
        )


@pytest.mark.parametrize("ratio", [1.0, 0.999])
def test_a_span_cut_inside_a_cached_document_is_the_full_prefills_first_tokens(
    blender: LayerwiseBlender, ratio: float
) -> None:
    docs = documents()
    warm(blender, docs)
    prompt = multi_doc_prompt(docs)
    full = blender.prefill(prompt, mode="full", store_result=False)
    end = 45  # inside the second document's blend segment (it starts at 33)

    result = span_pass(blender, prompt, end, ratio)

    assert result.kv.shape[2] == end and result.logits.numel() == 0
    assert result.summary.num_tokens == end and result.summary.num_blend_tokens == 27 + 12
    torch.testing.assert_close(result.kv, full.kv[:, :, :end], rtol=0, atol=1e-5)


def test_at_the_default_ratio_the_span_recomputes_its_gaps_its_selection_and_its_last_token(
    blender: LayerwiseBlender,
) -> None:
    docs = documents(2)
    warm(blender, docs)
    prompt = multi_doc_prompt(docs)
    end = 60

    result = span_pass(blender, prompt, end, 0.15)

    positions = result.recomputed_positions.tolist()
    assert positions == sorted(positions) and positions[-1] == end - 1
    gaps = [0, 1, 2, 3, 4, 32]  # the preamble and the first separator
    assert set(gaps) <= set(positions) and len(positions) < end // 2
    assert result.num_recomputed_tokens == len(positions)


def test_a_span_outside_the_prompt_is_refused_and_its_plan_released(blender: LayerwiseBlender) -> None:
    prompt = multi_doc_prompt(documents())
    with pytest.raises(ConfigError, match="span_end=500 is outside the 92-token prompt"):
        span_pass(blender, prompt, 500, 0.15)
    assert blender.store.stats().num_open_plans == 0


@pytest.mark.parametrize("policy", ["query_attention", "chunk_start+query_attention"])
def test_a_query_aware_span_is_chosen_by_the_question_past_it(blender: LayerwiseBlender, policy: str) -> None:
    """vLLM computes the question after the pass; with the tail scored up to the check layer, the span's selection
    is the one the whole prompt's pass makes, and the span's KV is that pass's first tokens."""
    docs = documents(3)
    warm(blender, docs)
    prompt = [*multi_doc_prompt(docs), 12, 13, 14, 15, 16, 17, 18, 19]  # a longer question, all past the span
    end = len(prompt) - 11  # the span ends at the last document's end
    settings = BlendConfig(recompute_ratio=0.2, selection=policy)  # type: ignore[arg-type]

    whole = span_pass(blender, prompt, len(prompt), settings)
    span = span_pass(blender, prompt, end, settings)

    assert span.kv.shape[2] == end and span.summary.num_tokens == end
    expected = sorted({p for p in whole.recomputed_positions.tolist() if p < end} | {end - 1})  # its last token
    assert span.recomputed_positions.tolist() == expected
    torch.testing.assert_close(span.kv[:, :, : end - 1], whole.kv[:, :, : end - 1], rtol=0, atol=1e-5)
    blind = span_pass(blender, prompt, end, BlendConfig(recompute_ratio=0.2, selection="kv_deviation"))
    assert blind.recomputed_positions.tolist() != span.recomputed_positions.tolist(), "another policy, other tokens"
