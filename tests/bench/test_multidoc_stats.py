"""Fact-accuracy intervals: Wilson for one mode, Agresti-Min for the paired difference with full prefill."""

from __future__ import annotations

import pytest

from kvstore.bench.multidoc_stats import paired_facts, wilson_interval
from kvstore.errors import InvalidInputError


def test_wilson_interval_matches_the_textbook_values() -> None:
    interval = wilson_interval(18, 24)  # 0.75 over 24 queries: about +-0.17
    assert interval.low == pytest.approx(0.5510, abs=1e-4) and interval.high == pytest.approx(0.8800, abs=1e-4)
    assert wilson_interval(0, 10).low == pytest.approx(0.0, abs=1e-12)
    assert wilson_interval(10, 10).high == pytest.approx(1.0, abs=1e-12)
    assert wilson_interval(0, 10).high > 0.2  # never a zero-width interval


def test_the_paired_counts_come_from_the_discordant_queries_only() -> None:
    full = [True, True, True, False, False, True, False, True]
    mode = [True, False, True, True, False, True, False, False]
    paired = paired_facts(full, mode)
    assert (paired.full_only, paired.mode_only, paired.num_queries) == (2, 1, 8)
    assert paired.agreement_ratio == pytest.approx(5 / 8) and paired.difference == pytest.approx(-1 / 8)
    assert paired.difference_ci95.low < paired.difference < paired.difference_ci95.high


def test_identical_answers_give_a_narrow_interval_around_zero_that_shrinks_with_more_queries() -> None:
    answers = [True] * 70 + [False] * 30
    narrow = paired_facts(answers, answers)
    assert narrow.difference == 0.0 and narrow.agreement_ratio == 1.0
    assert -0.03 < narrow.difference_ci95.low < 0.0 < narrow.difference_ci95.high < 0.03
    wide = paired_facts(answers[:20], answers[:20])
    assert wide.difference_ci95.high > narrow.difference_ci95.high


def test_the_paired_interval_is_narrower_than_the_accuracies_side_by_side() -> None:
    full = [True] * 60 + [False] * 40
    mode = [True] * 55 + [False] * 5 + [False] * 40  # five answers lost, none gained
    paired = paired_facts(full, mode)
    assert paired.difference == pytest.approx(-0.05)
    assert paired.difference_ci95.high < 0.0  # the loss is significant paired ...
    one = wilson_interval(55, 100)
    assert one.high > 0.6  # ... though 0.55 and 0.60 overlap as separate intervals


def test_mismatched_or_empty_answers_are_refused() -> None:
    with pytest.raises(InvalidInputError, match="same queries in both modes: 2 full vs 1"):
        paired_facts([True, False], [True])
    with pytest.raises(InvalidInputError):
        paired_facts([], [])
    with pytest.raises(InvalidInputError, match="need 0 <= correct <= queries"):
        wilson_interval(3, 2)
