"""Token selection at the check layer: top deviations among cached tokens, plus gaps, the last token and span heads."""

from __future__ import annotations

import pytest
import torch

from kvstore.blend.selection import (
    DeviationMetric,
    num_tokens_to_recompute,
    select_tokens,
    span_head_positions,
    token_deviation,
)
from kvstore.errors import InvalidInputError
from kvstore.keys import PrefixKey
from kvstore.plan import Segment
from kvstore.tiers.base import TierName


def test_the_top_deviations_gaps_and_the_last_token_are_selected() -> None:
    cached = torch.tensor([2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    deviation = torch.tensor([0.1, 9.0, 0.2, 0.3, 7.0, 0.4, 0.5, 0.6, 0.7, 0.8])
    forced = torch.tensor([0, 1, 12, 13])
    selected = select_tokens(scores=deviation, cached_positions=cached, forced_positions=forced,
                             recompute_ratio=0.2)  # fmt: skip
    assert selected.tolist() == [0, 1, 3, 6, 12, 13]


@pytest.mark.parametrize(("ratio", "expected"), [(0.0, 0), (0.01, 1), (0.15, 2), (0.5, 5), (1.0, 10)])
def test_the_ratio_rounds_up_so_any_positive_ratio_selects_a_token(ratio: float, expected: int) -> None:
    assert num_tokens_to_recompute(ratio, 10) == expected
    selected = select_tokens(scores=torch.arange(10.0), cached_positions=torch.arange(10),
                             forced_positions=torch.tensor([10]), recompute_ratio=ratio)  # fmt: skip
    assert selected.tolist() == list(range(10 - expected, 11))


def test_a_last_token_that_is_also_cached_is_selected_once() -> None:
    selected = select_tokens(scores=torch.tensor([5.0, 1.0]), cached_positions=torch.tensor([3, 4]),
                             forced_positions=torch.tensor([4]), recompute_ratio=0.5)  # fmt: skip
    assert selected.tolist() == [3, 4]


def test_deviation_is_the_squared_distance_of_k_and_optionally_v() -> None:
    fresh = torch.zeros(3, 2, 4)
    cached = torch.zeros(3, 2, 4)
    cached[1, 0, 0] = 2.0
    values = torch.zeros(3, 2, 4)
    cached_values = torch.zeros(3, 2, 4)
    cached_values[2, 1, 3] = 3.0
    assert token_deviation(DeviationMetric.KEY, fresh, cached, values, cached_values).tolist() == [0.0, 4.0, 0.0]
    assert token_deviation(DeviationMetric.VALUE, fresh, cached, values, cached_values).tolist() == [0.0, 0.0, 9.0]
    assert token_deviation(DeviationMetric.KEY_VALUE, fresh, cached, values, cached_values).tolist() == [0, 4, 9]
    half = token_deviation(DeviationMetric.KEY, fresh.bfloat16(), cached.bfloat16(), values, cached_values)
    assert half.dtype == torch.float32


def test_mismatched_lengths_are_refused() -> None:
    with pytest.raises(InvalidInputError, match="one value per cached position"):
        select_tokens(scores=torch.ones(3), cached_positions=torch.arange(4), forced_positions=torch.tensor([5]),
                      recompute_ratio=0.5)  # fmt: skip


def _segment(start: int, num_tokens: int, source_start: int, *, exact: bool = False) -> Segment:
    return Segment(start=start, num_tokens=num_tokens, key=PrefixKey(bytes(16)), source_start=source_start,
                   exact=exact, tier=TierName.CPU)  # fmt: skip


def test_span_heads_are_the_first_tokens_of_each_run_continuing_one_cached_sequence() -> None:
    segments = [
        _segment(0, 8, 0, exact=True),  # exact prefix: never a head
        _segment(10, 8, 0),  # document A placed at 10: a span starts (its source starts at 0)
        _segment(18, 8, 8),  # continues A in the prompt and in the source
        _segment(26, 8, 0),  # document B right behind A: contiguous in the prompt, a new source run
        _segment(40, 8, 16),  # after a gap: a new span even though its source is not at 0
    ]
    assert span_head_positions(segments, 3, 48).tolist() == [10, 11, 12, 26, 27, 28, 40, 41, 42]
    assert span_head_positions(segments, 0, 48).tolist() == []


def test_span_heads_longer_than_a_segment_reach_into_the_next_one_and_stop_at_the_span() -> None:
    segments = [_segment(4, 2, 0), _segment(6, 2, 2), _segment(8, 4, 4), _segment(12, 4, 0)]
    assert span_head_positions(segments, 5, 16).tolist() == [4, 5, 6, 7, 8, 12, 13, 14, 15]


def test_an_exact_segment_ends_a_span() -> None:
    segments = [_segment(0, 4, 0), _segment(4, 4, 4, exact=True), _segment(8, 4, 8)]
    assert span_head_positions(segments, 2, 12).tolist() == [0, 1, 8, 9]
