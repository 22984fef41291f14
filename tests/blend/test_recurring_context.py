"""``recurring_context_positions`` and ``BlendConfig.recurring_context_tokens``: reused tokens whose context already
appeared earlier in the prompt are recomputed on top of the ratio; ratios 0 and 1.0 keep their meaning."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.blend import BlendConfig, LayerwiseBlender
from kvstore.blend.recurring_context import recurring_context_positions
from kvstore.blend.selection import num_tokens_to_recompute, reused_span_starts
from kvstore.errors import ConfigError
from kvstore.keys import PrefixKey
from kvstore.plan import Segment
from kvstore.tiers.base import TierName

CHUNK = 8


def _segment(start: int, num_tokens: int, source_start: int, *, exact: bool = False) -> Segment:
    return Segment(start=start, num_tokens=num_tokens, key=PrefixKey(bytes(16)), source_start=source_start,
                   exact=exact, tier=TierName.CPU)  # fmt: skip


def _reference(tokens: list[int], segments: list[Segment], match_tokens: int) -> list[int]:
    """Token by token, the definition: a reused token whose last ``match_tokens`` tokens lie in its span and occur
    as a run that ends before the span starts."""
    starts = reused_span_starts(segments, len(tokens))
    found = []
    for end in range(len(tokens)):
        span_start = int(starts[end])
        begin = end - match_tokens + 1
        if span_start < 0 or begin < span_start:
            continue
        run = tokens[begin : end + 1]
        if any(tokens[e - match_tokens + 1 : e + 1] == run for e in range(match_tokens - 1, span_start)):
            found.append(end)
    return found


def test_a_pattern_seen_in_an_earlier_document_marks_the_tokens_that_end_it() -> None:
    pattern = [7, 8, 9, 10]
    tokens = np.array([1, 2, *pattern, 3, 4, 5, 6, 11, *pattern, 12])  # document B (from 8) repeats A's pattern
    segments = [_segment(0, 8, 0), _segment(8, 8, 0)]  # two spans, each stored alone
    assert recurring_context_positions(tokens, segments, 2).tolist() == [12, 13, 14]  # ends of 8 9, 9 10, 10 ...
    assert recurring_context_positions(tokens, segments, 4).tolist() == [14]  # only the whole pattern
    assert recurring_context_positions(tokens, segments, 5).tolist() == []
    # Exact segments never count, and a repeat inside one span is not cross-document.
    assert recurring_context_positions(tokens, [_segment(0, 8, 0), _segment(8, 8, 8, exact=True)], 2).tolist() == []
    assert recurring_context_positions(tokens, [_segment(0, 16, 0)], 2).tolist() == []


@settings(max_examples=60, deadline=None)
@given(data=st.data(), match_tokens=st.integers(1, 4))
def test_positions_equal_the_token_by_token_definition(data: st.DataObject, match_tokens: int) -> None:
    tokens = data.draw(st.lists(st.integers(0, 3), min_size=0, max_size=40))  # a small vocabulary: many repeats
    segments, position = [], 0
    while position < len(tokens):
        length = data.draw(st.integers(1, len(tokens) - position))
        kind = data.draw(st.sampled_from(["gap", "exact", "blend", "continued"]))
        if kind != "gap":
            source = segments[-1].source_start + segments[-1].num_tokens if kind == "continued" and segments else 0
            segments.append(_segment(position, length, source, exact=kind == "exact"))
        position += length
    found = recurring_context_positions(np.asarray(tokens, dtype=np.int64), segments, match_tokens).tolist()
    assert found == _reference(tokens, segments, match_tokens)


def test_recurring_tokens_are_recomputed_on_top_of_the_ratio_and_ratios_0_and_1_keep_their_meaning(
    tiny_blender: LayerwiseBlender,
) -> None:
    blender = tiny_blender
    rng = np.random.default_rng(1)
    pattern = rng.integers(3, 500, 6).tolist()
    first = rng.integers(3, 500, 10).tolist() + pattern + rng.integers(3, 500, 8).tolist()  # 24 tokens
    second = rng.integers(3, 500, 14).tolist() + pattern + rng.integers(3, 500, 4).tolist()  # 24 tokens
    for document in (first, second):
        blender.prefill(document, mode="full")
    tokens = [1, 2, 3, *first, 4, *second, 5, 6]
    plain = blender.prefill(tokens, store_result=False, config=BlendConfig(recompute_ratio=0.15))
    recurring = blender.prefill(tokens, store_result=False,
                                config=BlendConfig(recompute_ratio=0.15, recurring_context_tokens=3))  # fmt: skip
    assert recurring.plan.num_blend_tokens == plain.plan.num_blend_tokens == 48
    num_gap_tokens = len(tokens) - 48
    # The pattern's last 4 tokens end a 3-token run seen in the first document; the ratio chooses among the rest.
    assert recurring.num_recomputed_tokens == num_gap_tokens + 4 + num_tokens_to_recompute(0.15, 48 - 4)
    assert plain.num_recomputed_tokens == num_gap_tokens + num_tokens_to_recompute(0.15, 48)
    reuse = blender.prefill(tokens, store_result=False, config=BlendConfig(recompute_ratio=0.0))
    reuse_recurring = blender.prefill(tokens, store_result=False,
                                      config=BlendConfig(recompute_ratio=0.0, recurring_context_tokens=3))  # fmt: skip
    assert reuse_recurring.num_recomputed_tokens == reuse.num_recomputed_tokens == num_gap_tokens
    full = blender.prefill(tokens, mode="full", store_result=False)
    exact = blender.prefill(tokens, store_result=False,
                            config=BlendConfig(recompute_ratio=1.0, recurring_context_tokens=3))  # fmt: skip
    torch.testing.assert_close(exact.logits, full.logits, rtol=0, atol=1e-5)


def test_a_negative_run_length_is_refused() -> None:
    with pytest.raises(ConfigError, match="recurring_context_tokens=-2 must be a token count >= 0"):
        BlendConfig(recurring_context_tokens=-2)
