"""``paired_ratio``: a deployment's time over a reference's from interleaved pairs, and whether its interval can tell
2% from noise."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.bench.paired_ratio import paired_ratio
from kvstore.errors import InvalidInputError


def test_a_steady_two_percent_under_drift_is_resolved() -> None:
    rng = random.Random(1)
    drift = [1.0 + 0.4 * index / 30 for index in range(30)]  # the machine slows by 40% over the run
    reference = [0.5 * step * rng.uniform(0.99, 1.01) for step in drift]
    measured = [0.5 * 1.02 * step * rng.uniform(0.99, 1.01) for step in drift]
    estimate = paired_ratio(reference, measured)
    assert estimate.pairs == 30
    assert estimate.low > 1.0 and 1.01 < estimate.ratio < 1.03 and estimate.high < 1.04


@given(st.lists(st.floats(min_value=0.01, max_value=10.0), min_size=1, max_size=40))
def test_equal_times_give_one_and_the_interval_holds_the_estimate(times: list[float]) -> None:
    same = paired_ratio(times, times)
    assert same.ratio == pytest.approx(1.0) and same.low == pytest.approx(1.0) and same.high == pytest.approx(1.0)
    slower = paired_ratio(times, [2 * time for time in reversed(times)])
    assert slower.low <= slower.ratio <= slower.high


def test_unequal_empty_or_non_positive_times_are_refused() -> None:
    with pytest.raises(InvalidInputError, match="give equal"):
        paired_ratio([1.0], [1.0, 2.0])
    with pytest.raises(InvalidInputError, match="give equal"):
        paired_ratio([], [])
    with pytest.raises(InvalidInputError, match="positive"):
        paired_ratio([1.0, 0.0], [1.0, 1.0])


def test_strata_keep_a_balanced_order_effect_out_of_the_interval() -> None:
    """Half the pairs 14% slow, half 14% fast (the start order of an interleaved pair), each with 1% noise: the mean
    is 1 either way; resampled within each half the interval is as tight as the noise, pooled it holds the effect."""
    rng = random.Random(2)
    reference = [1.0] * 16
    measured = [(1.14 if index < 8 else 1 / 1.14) * rng.uniform(0.99, 1.01) for index in range(16)]
    strata = [index // 8 for index in range(16)]
    stratified, pooled = paired_ratio(reference, measured, strata=strata), paired_ratio(reference, measured)
    assert stratified.ratio == pooled.ratio == pytest.approx(1.0, abs=0.01)
    assert stratified.high - stratified.low < 0.02 < 0.1 < pooled.high - pooled.low
    with pytest.raises(InvalidInputError, match="give equal"):
        paired_ratio(reference, measured, strata=strata[:-1])
