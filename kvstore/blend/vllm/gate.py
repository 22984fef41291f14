"""Blend only when the pass is expected to beat vLLM's own prefill of the same tokens: a blend is never slower.

A blend pass replaces vLLM's prefill of the span ``[exact_end, end)`` (what the exact path would leave vLLM to
compute, up to the pass's end) by: loading, re-rotating and writing every span token's KV, computing every token in
the layers up to the check layer, and only the selected share (and the gaps) after it. Whether that wins depends on
the machine, the model, the span and its reuse, so the gate learns two rates from the engine itself and decides per
request::

    prefill_ms = dense_ms_per_token * (end - exact_end)
    pass_ms    = overhead_ms_per_token * span_tokens
               + dense_ms_per_token * (span_tokens * early + (gap_tokens + ratio * reused_tokens) * (1 - early))

``early`` is the share of layers up to the check layer. ``dense_ms_per_token`` comes from the engine's prefill steps
without a pass (the worker times each step's forward); ``overhead_ms_per_token`` from the passes it ran: what a pass
took beyond its compute, per span token (loads, RoPE, block writes), the engine's first pass left out (it pays
one-time costs: buffers, the model's first sparse kernels). Both are running medians of the last few
observations. The gate blends when ``pass_ms <= margin * prefill_ms``; until the engine has run a plain prefill it
blends (nothing to compare with yet), and the first passes teach the overhead. A prefill rate learnt on shorter
prompts underestimates a long prompt's (attention grows with context), which errs towards refusing: the gate may
miss a blend that would have paid, never the other way round by that cause.

Pure arithmetic over counts and times; no engine imports (the scheduler side runs it).
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.plan import Segment

__all__ = ["BlendGate", "GateDecision", "SpanMakeup", "span_makeup"]

logger = logging.getLogger(__name__)

MIN_PREFILL_STEP_TOKENS = 128
"""Steps with fewer tokens (decodes, small tails) teach nothing about the prefill rate: their time is overhead."""


@dataclass(frozen=True, slots=True)
class SpanMakeup:
    """What a pass over ``[start, end)`` would do with each token of it."""

    span_tokens: int
    exact_tokens: int
    reused_tokens: int
    gap_tokens: int


def span_makeup(segments: Sequence[Segment], start: int, end: int) -> SpanMakeup:
    """Exact, blend (reused) and gap tokens of ``[start, end)`` under a plan's segments."""
    exact = reused = 0
    for segment in segments:
        overlap = min(segment.end, end) - max(segment.start, start)
        if overlap <= 0:
            continue
        if segment.exact:
            exact += overlap
        else:
            reused += overlap
    span = max(end - start, 0)
    return SpanMakeup(span_tokens=span, exact_tokens=exact, reused_tokens=reused, gap_tokens=span - exact - reused)


@dataclass(frozen=True, slots=True)
class GateDecision:
    """The gate's answer for one request, with what it expected (``None``: not known yet)."""

    blend: bool
    pass_ms: float | None
    prefill_ms: float | None


class BlendGate:
    """Learns an engine's prefill and blend-pass rates and says whether a pass is worth running.

    Args:
        num_layers: the model's layers.
        check_layer: the pass's check layer (layers ``0..check_layer`` compute every span token).
        margin: blend only when the pass is expected to take at most this share of the prefill it replaces.
        window: observations each running median covers.

    Threads: the scheduler side's (one engine core thread).
    """

    def __init__(self, *, num_layers: int, check_layer: int, margin: float = 0.95, window: int = 16) -> None:
        self._early = min(check_layer + 1, num_layers) / max(num_layers, 1)
        self._margin = margin
        self._dense_ms_per_token: deque[float] = deque(maxlen=window)
        self._overhead_ms_per_token: deque[float] = deque(maxlen=window)
        self._first_pass_seen = False

    @property
    def dense_ms_per_token(self) -> float | None:
        return statistics.median(self._dense_ms_per_token) if self._dense_ms_per_token else None

    @property
    def overhead_ms_per_token(self) -> float | None:
        return statistics.median(self._overhead_ms_per_token) if self._overhead_ms_per_token else None

    def observe_prefill_step(self, step_ms: float, num_tokens: int) -> None:
        """A forward step without a pass computed ``num_tokens`` in ``step_ms``."""
        if num_tokens >= MIN_PREFILL_STEP_TOKENS and step_ms > 0.0:
            self._dense_ms_per_token.append(step_ms / num_tokens)

    def observe_pass(self, makeup: SpanMakeup, ratio: float, pass_ms: float) -> None:
        """A pass over ``makeup`` at ``ratio`` took ``pass_ms``: what it took beyond its compute, per span token."""
        dense = self.dense_ms_per_token
        if dense is None or makeup.span_tokens <= 0 or pass_ms <= 0.0:
            return
        if not self._first_pass_seen:
            self._first_pass_seen = True  # a warm-up: what it cost says little about the passes after it
            return
        overhead = (pass_ms - dense * self._compute_tokens(makeup, ratio)) / makeup.span_tokens
        self._overhead_ms_per_token.append(max(overhead, 0.0))

    def decide(self, makeup: SpanMakeup, ratio: float, replaced_tokens: int) -> GateDecision:
        """Blend ``makeup`` at ``ratio``, or let vLLM prefill the ``replaced_tokens`` the pass would produce?"""
        dense = self.dense_ms_per_token
        if dense is None:
            return GateDecision(blend=True, pass_ms=None, prefill_ms=None)
        prefill_ms = dense * replaced_tokens
        pass_ms = dense * self._compute_tokens(makeup, ratio) + (self.overhead_ms_per_token or 0.0) * makeup.span_tokens
        decision = GateDecision(blend=pass_ms <= self._margin * prefill_ms, pass_ms=pass_ms, prefill_ms=prefill_ms)
        logger.debug(
            "blend gate: pass ~%.0f ms over %d tokens (%d reused, %d gaps) against ~%.0f ms of prefill: %s",
            pass_ms, makeup.span_tokens, makeup.reused_tokens, makeup.gap_tokens, prefill_ms,
            "blend" if decision.blend else "prefill",
        )  # fmt: skip
        return decision

    def _compute_tokens(self, makeup: SpanMakeup, ratio: float) -> float:
        """Dense-token equivalents a pass computes: every span token up to the check layer, then the gaps and the
        selected share of the reused tokens (exact tokens are loaded as they are)."""
        later = makeup.gap_tokens + ratio * makeup.reused_tokens
        return makeup.span_tokens * self._early + later * (1.0 - self._early)
