"""The blend gate: a pass runs only when it is expected to beat the engine's own prefill of the tokens it replaces."""

from __future__ import annotations

import pytest

from kvstore.blend.vllm.gate import BlendGate, SpanMakeup, span_makeup
from kvstore.plan import Segment
from kvstore.tiers.base import TierName

KEY = b"k" * 16


def segment(start: int, num_tokens: int, *, exact: bool) -> Segment:
    return Segment(
        start=start, num_tokens=num_tokens, key=KEY, source_start=0 if exact else 999, exact=exact, tier=TierName.CPU
    )  # type: ignore[arg-type]


def test_the_span_is_counted_by_what_each_token_is() -> None:
    segments = [segment(0, 64, exact=True), segment(100, 200, exact=False), segment(400, 50, exact=False)]
    makeup = span_makeup(segments, 32, 420)
    assert makeup == SpanMakeup(span_tokens=388, exact_tokens=32, reused_tokens=220, gap_tokens=136)


def test_before_any_plain_prefill_the_gate_blends() -> None:
    gate = BlendGate(num_layers=30, check_layer=1)
    decision = gate.decide(SpanMakeup(1000, 0, 0, 1000), 0.15, 1000)
    assert decision.blend and decision.pass_ms is None


def test_a_well_reused_span_blends_and_a_mostly_computed_one_does_not() -> None:
    gate = BlendGate(num_layers=30, check_layer=1)
    for _ in range(3):
        gate.observe_prefill_step(2000.0, 1000)  # 2 ms a token
    gate.observe_prefill_step(500.0, 8)  # a decode step: overhead, not a rate
    assert gate.dense_ms_per_token == pytest.approx(2.0)
    reused = gate.decide(SpanMakeup(1000, 0, 1000, 0), 0.15, 1000)
    assert reused.blend and reused.pass_ms == pytest.approx(2.0 * (1000 * 2 / 30 + 150 * 28 / 30))
    computed = gate.decide(SpanMakeup(1000, 0, 50, 950), 0.15, 1000)
    assert not computed.blend and computed.prefill_ms == pytest.approx(2000.0)


def test_a_slow_pass_teaches_the_gate_to_refuse_the_next() -> None:
    gate = BlendGate(num_layers=30, check_layer=1)
    gate.observe_prefill_step(2000.0, 1000)
    makeup = SpanMakeup(1000, 0, 1000, 0)
    assert gate.decide(makeup, 0.15, 1000).blend
    gate.observe_pass(makeup, 0.15, 9000.0)  # the engine's first pass: a warm-up, not learnt from
    assert gate.overhead_ms_per_token is None and gate.decide(makeup, 0.15, 1000).blend
    gate.observe_pass(makeup, 0.15, 2500.0)  # the pass took longer than a prefill: loads, rotations, writes
    assert gate.overhead_ms_per_token is not None and gate.overhead_ms_per_token > 2.0
    assert not gate.decide(makeup, 0.15, 1000).blend
    gate.observe_pass(makeup, 0.15, 300.0)
    gate.observe_pass(makeup, 0.15, 300.0)  # faster passes since: the median follows
    assert gate.decide(makeup, 0.15, 1000).blend
