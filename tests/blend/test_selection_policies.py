"""Selection policies: what each one recomputes where the right tokens are known, that the budget is one ratio of
the reused tokens whatever the policy, that ratio 1.0 is a full prefill under every policy, and bad settings."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore import StoreConfig, TieredStore
from kvstore.blend import BlendConfig, LayerwiseBlender, SelectionPolicy
from kvstore.blend.layerwise import run_blend_pass
from kvstore.blend.selection import (
    num_tokens_to_recompute,
    query_attention_mass,
    select_tokens,
    span_start_order,
)
from kvstore.errors import ConfigError
from kvstore.keys import PrefixKey, as_token_array
from kvstore.models import RandomInitModel, random_init_model
from kvstore.plan import Segment
from kvstore.tiers.base import TierName

CHUNK = 8
DOC_TOKENS = 24  # three whole chunks: every document is one reused span of 24 tokens


@pytest.fixture(scope="module")
def eager_tiny() -> RandomInitModel:
    """The tiny random Llama with eager attention, so a full forward reports its attention weights."""
    loaded = random_init_model("tiny-llama", dtype=torch.float32, seed=0)
    loaded.model.set_attn_implementation("eager")
    return loaded


@pytest.fixture
def blender(eager_tiny: RandomInitModel, tmp_path: Path) -> Iterator[LayerwiseBlender]:
    config = StoreConfig(tiers=(TierName.CPU,), chunk_size=CHUNK, cpu_capacity_bytes=64 << 20,
                         data_dir=tmp_path / "data", enable_blend=True)  # fmt: skip
    with TieredStore(eager_tiny.layout, config) as store, LayerwiseBlender(eager_tiny.model, store) as blender:
        yield blender


def _documents(seed: int, num: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, DOC_TOKENS).tolist() for _ in range(num)]


def _prompt(docs: list[list[int]]) -> tuple[list[int], list[int]]:
    """Documents in another order behind a preamble, separators between, a question: and each document's start."""
    prompt: list[int] = [1, 2, 3]
    starts = []
    for doc in (docs[2], docs[0], docs[1]):
        starts.append(len(prompt))
        prompt += [*doc, 7]
    return [*prompt, 9, 10, 11, 12], starts


def _warmed(blender: LayerwiseBlender, seed: int) -> tuple[list[int], list[int]]:
    docs = _documents(seed)
    for doc in docs:
        blender.prefill(doc, mode="full")  # each document cached alone, at position 0
    return _prompt(docs)


def _recomputed_blend(result: object, starts: list[int]) -> list[int]:
    positions = result.recomputed_positions.tolist()  # type: ignore[attr-defined]
    return [p for p in positions if any(start <= p < start + DOC_TOKENS for start in starts)]


def _blend_positions(starts: list[int]) -> list[int]:
    return [start + offset for start in starts for offset in range(DOC_TOKENS)]


# -- the pieces --------------------------------------------------------------------------------------------------


def test_query_attention_mass_is_the_causal_softmax_summed_over_queries_and_heads() -> None:
    generator = torch.Generator().manual_seed(3)
    num_tokens, num_kv_heads, group, head_dim = 37, 2, 3, 8
    keys = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator)
    query_positions = torch.tensor([4, 11, 20, 30, 35, 36])
    query = torch.randn(num_kv_heads * group, len(query_positions), head_dim, generator=generator)
    expected = torch.zeros(num_tokens)
    for head in range(num_kv_heads * group):
        key_head = keys[:, head // group]
        for row, position in enumerate(query_positions.tolist()):
            scores = key_head[: position + 1] @ query[head, row] / math.sqrt(head_dim)
            expected[: position + 1] += torch.softmax(scores, dim=0)
    mass = query_attention_mass(query, query_positions, keys, block_queries=4)  # two blocks, the last partial
    torch.testing.assert_close(mass, expected, rtol=1e-5, atol=1e-5)
    assert math.isclose(float(mass.sum()), len(query_positions) * num_kv_heads * group, rel_tol=1e-5)


def test_query_attention_mass_lands_on_the_key_a_question_matches() -> None:
    keys = torch.zeros(20, 1, 4)
    keys[13, 0] = torch.tensor([0.0, 8.0, 0.0, 0.0])  # the one sentence the question is about
    query = torch.tensor([[[0.0, 4.0, 0.0, 0.0], [0.0, 3.0, 0.0, 0.0]]])  # one head, two question tokens
    mass = query_attention_mass(query, torch.tensor([18, 19]), keys)
    assert int(mass.argmax()) == 13 and float(mass[13]) > 1.9


def _segment(start: int, num_tokens: int, source_start: int, *, exact: bool = False) -> Segment:
    key = PrefixKey(start.to_bytes(16, "little"))
    return Segment(start=start, num_tokens=num_tokens, key=key, source_start=source_start, exact=exact,
                   tier=TierName.CPU)  # fmt: skip


def test_span_starts_come_every_spans_first_token_before_any_second() -> None:
    segments = [_segment(0, 8, 0, exact=True), _segment(10, 8, 0), _segment(18, 8, 8), _segment(30, 8, 40)]
    order = span_start_order(segments, num_start_tokens=3, num_tokens=40)
    assert order.tolist() == [10, 30, 11, 31, 12, 32]  # two spans: 10-26 (continued) and 30-38; exact skipped


def test_span_starts_take_the_budget_first_and_the_scorer_the_rest() -> None:
    cached = torch.arange(10, 30)
    scores = torch.zeros(20)
    scores[15] = 9.0  # position 25
    scores[0] = 8.0  # position 10: already a span start, so the scorer's next pick is not it
    scores[7] = 7.0  # position 17
    first = torch.tensor([10, 20, 11, 21])
    forced = torch.tensor([30])
    budget = num_tokens_to_recompute(0.3, 20)  # 6
    selected = select_tokens(scores=scores, cached_positions=cached, forced_positions=forced, recompute_ratio=0.3,
                             first_positions=first)  # fmt: skip
    assert selected.tolist() == [10, 11, 17, 20, 21, 25, 30] and len(selected) == budget + 1
    starts_only = select_tokens(scores=None, cached_positions=cached, forced_positions=forced, recompute_ratio=0.1,
                                first_positions=first)  # fmt: skip
    assert starts_only.tolist() == [10, 20, 30], "a budget of 2 takes the first token of each span"


# -- inside a blended prefill ------------------------------------------------------------------------------------


def test_query_attention_recomputes_what_the_question_attends_to_most(
    blender: LayerwiseBlender, eager_tiny: RandomInitModel
) -> None:
    """With documents cached alone every token is computed up to the check layer, so the pass's scores are a full
    prefill's attention at that layer: the rows of the computed tokens (preamble, separators, question), summed."""
    prompt, starts = _warmed(blender, seed=11)
    config = BlendConfig(recompute_ratio=0.2, check_layer=1, selection="query_attention")  # type: ignore[arg-type]
    blended = blender.prefill(prompt, store_result=False, config=config)
    blend = _blend_positions(starts)
    computed = [p for p in range(len(prompt)) if p not in blend]
    with torch.inference_mode():
        attentions = eager_tiny.model(torch.tensor([prompt]), output_attentions=True).attentions
    mass = attentions[1][0][:, computed].sum(dim=(0, 1))  # heads x computed rows -> one value per key position
    budget = num_tokens_to_recompute(0.2, len(blend))
    expected = sorted(torch.tensor(blend)[torch.topk(mass[blend], budget).indices].tolist())
    assert _recomputed_blend(blended, starts) == expected
    assert blended.num_recomputed_tokens == budget + len(computed)


def test_chunk_start_recomputes_every_reused_spans_first_tokens(blender: LayerwiseBlender) -> None:
    """A document cached alone has its attention sink at its first token; placed mid-prompt, that token is stale."""
    prompt, starts = _warmed(blender, seed=12)
    roomy = BlendConfig(recompute_ratio=0.15, selection="chunk_start", chunk_start_tokens=2)  # type: ignore[arg-type]
    blended = blender.prefill(prompt, store_result=False, config=roomy)
    assert _recomputed_blend(blended, starts) == sorted(s + offset for s in starts for offset in (0, 1))
    tight = BlendConfig(recompute_ratio=0.05, selection="chunk_start", chunk_start_tokens=2)  # type: ignore[arg-type]
    assert num_tokens_to_recompute(0.05, 3 * DOC_TOKENS) == 4
    blended = blender.prefill(prompt, store_result=False, config=tight)
    assert _recomputed_blend(blended, starts) == sorted([*starts, min(starts) + 1]), "first tokens first"


@pytest.mark.parametrize("policy", ["chunk_start+query_attention", "chunk_start+kv_deviation"])
def test_combined_policies_spend_one_budget(blender: LayerwiseBlender, policy: str) -> None:
    prompt, starts = _warmed(blender, seed=13)
    config = BlendConfig(recompute_ratio=0.2, selection=policy, chunk_start_tokens=2)  # type: ignore[arg-type]
    blended = blender.prefill(prompt, store_result=False, config=config)
    recomputed = _recomputed_blend(blended, starts)
    assert len(recomputed) == num_tokens_to_recompute(0.2, 3 * DOC_TOKENS), "the starts count inside the budget"
    assert {s + offset for s in starts for offset in (0, 1)} <= set(recomputed)


@pytest.mark.parametrize("policy", [policy.value for policy in SelectionPolicy])
def test_ratio_one_reproduces_full_prefill_under_every_policy(blender: LayerwiseBlender, policy: str) -> None:
    prompt, _ = _warmed(blender, seed=14)
    full = blender.prefill(prompt, mode="full", store_result=False)
    for ratio in (1.0, 0.999):  # 0.999 narrows at the check layer yet selects every cached token
        if policy == "chunk_start" and ratio < 1.0:
            continue  # it spends only the span starts: below 1.0 its budget is a cap, not a quota
        config = BlendConfig(recompute_ratio=ratio, selection=policy)  # type: ignore[arg-type]
        blended = blender.prefill(prompt, store_result=False, config=config)
        assert blended.num_recomputed_tokens == len(prompt)
        torch.testing.assert_close(blended.logits, full.logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(blended.kv, full.kv, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"selection": "attention"}, "selection='attention' is not one of kv_deviation, query_attention"),
        ({"chunk_start_tokens": 0}, "chunk_start_tokens=0 must be a token count >= 1"),
        ({"chunk_start_tokens": 2.5}, "chunk_start_tokens=2.5 must be a token count >= 1"),
        ({"chunk_start_tokens": True}, "chunk_start_tokens=True must be a token count >= 1"),
    ],
)
def test_bad_policy_settings_are_refused_with_one_line(settings: dict[str, object], says: str) -> None:
    with pytest.raises(ConfigError, match=says) as raised:
        BlendConfig(**settings)  # type: ignore[arg-type]
    assert "\n" not in str(raised.value)


def test_a_span_cut_inside_a_document_selects_by_the_whole_prompts_question(
    blender: LayerwiseBlender, eager_tiny: RandomInitModel
) -> None:
    """vLLM's span ends on a block boundary, often inside the last document: the document's rest, past the span, is
    cached KV the question attends over, not a query; the question past the span still scores the span's tokens."""
    prompt, starts = _warmed(blender, seed=15)
    end = starts[-1] + DOC_TOKENS // 2  # half of the last document lies past the span
    config = BlendConfig(recompute_ratio=0.2, selection="query_attention")  # type: ignore[arg-type]
    with blender.store.session() as session, torch.inference_mode():
        result = run_blend_pass(
            stack=blender._stack, rotator=blender._rotator, loader=blender._loader, owner=session,
            layout=blender.layout, tokens=as_token_array(prompt), settings=config, clock=blender._clock,
            costs=blender.load_costs, span_end=end, need_logits=False,
        )  # fmt: skip
    blend = _blend_positions(starts)
    computed = [p for p in range(len(prompt)) if p not in blend]  # the question and separators: the queries
    with torch.inference_mode():
        attentions = eager_tiny.model(torch.tensor([prompt]), output_attentions=True).attentions
    mass = attentions[1][0][:, computed].sum(dim=(0, 1))
    candidates = torch.tensor([p for p in blend if p < end])
    budget = num_tokens_to_recompute(0.2, len(candidates))
    expected = sorted(candidates[torch.topk(mass[candidates], budget).indices].tolist())
    selected = [p for p in result.recomputed_positions.tolist() if p in set(candidates.tolist()) and p != end - 1]
    assert selected == [p for p in expected if p != end - 1]
