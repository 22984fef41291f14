"""Token selection at the check layer: top deviations among cached tokens, plus gaps and the last token."""

from __future__ import annotations

import pytest
import torch

from kvstore.blend.selection import DeviationMetric, num_tokens_to_recompute, select_tokens, token_deviation
from kvstore.errors import InvalidInputError


def test_the_top_deviations_gaps_and_the_last_token_are_selected() -> None:
    cached = torch.tensor([2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    deviation = torch.tensor([0.1, 9.0, 0.2, 0.3, 7.0, 0.4, 0.5, 0.6, 0.7, 0.8])
    forced = torch.tensor([0, 1, 12, 13])
    selected = select_tokens(deviation=deviation, cached_positions=cached, forced_positions=forced,
                             recompute_ratio=0.2)  # fmt: skip
    assert selected.tolist() == [0, 1, 3, 6, 12, 13]


@pytest.mark.parametrize(("ratio", "expected"), [(0.0, 0), (0.01, 1), (0.15, 2), (0.5, 5), (1.0, 10)])
def test_the_ratio_rounds_up_so_any_positive_ratio_selects_a_token(ratio: float, expected: int) -> None:
    assert num_tokens_to_recompute(ratio, 10) == expected
    selected = select_tokens(deviation=torch.arange(10.0), cached_positions=torch.arange(10),
                             forced_positions=torch.tensor([10]), recompute_ratio=ratio)  # fmt: skip
    assert selected.tolist() == list(range(10 - expected, 11))


def test_a_last_token_that_is_also_cached_is_selected_once() -> None:
    selected = select_tokens(deviation=torch.tensor([5.0, 1.0]), cached_positions=torch.tensor([3, 4]),
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
        select_tokens(deviation=torch.ones(3), cached_positions=torch.arange(4), forced_positions=torch.tensor([5]),
                      recompute_ratio=0.5)  # fmt: skip
