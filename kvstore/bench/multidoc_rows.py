"""Rows of ``kvstore bench multi-doc-qa`` / ``shuffle``: one per mode, summarising every timed query.

Latencies are reported as mean, p50, p90, p99 and max (nearest rank) of ``total_ms`` (TTFT); ``speedup_vs_full`` is
the mean full-prefill TTFT of the same run divided by the mode's mean. Stage times are means. Quality fields are
means over queries, ``None`` when quality was not measured (random-init models). Fact accuracy comes with its 95%
interval and with the paired comparison against full prefill on the same queries (``kvstore.bench.multidoc_stats``):
``fact_full_only`` / ``fact_mode_only`` count the queries only one of the two answers right, and
``fact_difference_vs_full`` (mode minus full) has its own, much narrower, interval.

Pure values and functions; thread-safe.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.bench.multidoc_stats import paired_facts, wilson_interval
from kvstore.blend import PrefillTimings

__all__ = ["MultiDocRow", "QuerySample", "RunContext", "summarize"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RunContext:
    """What every row of one run repeats: the workload, the model and where it ran."""

    bench: str
    selection: str
    chunk_start_tokens: int
    check_layer: int
    deviation: str
    num_head_tokens: int
    recurring_context_tokens: int
    stale_key_scale: float
    disk_policy: str
    seed: int
    model: str
    device: str
    dtype: str
    tiers: str
    chunk_size: int
    chunking: str
    warm_up: str
    facts: str
    num_documents: int
    document_tokens: int
    docs_per_query: int


@dataclass(frozen=True, slots=True, kw_only=True)
class QuerySample:
    """One query in one mode; quality fields are ``None`` when not measured."""

    timings: PrefillTimings
    prompt_tokens: int
    exact_tokens: int
    blend_tokens: int
    recomputed_tokens: int
    skipped_disk_tokens: int
    top1: bool | None = None
    kl: float | None = None
    continuation_match: float | None = None
    fact_correct: bool | None = None

    def to_json_dict(self) -> dict[str, str | int | float | bool | None]:
        """The sample as one flat JSON object (``--samples``): the quality fields and the stage timings."""
        fields: dict[str, str | int | float | bool | None] = {
            name: getattr(self, name) for name in self.__slots__ if name != "timings"
        }
        fields.update(dataclasses.asdict(self.timings))
        return fields


@dataclass(frozen=True, slots=True, kw_only=True)
class MultiDocRow(RunContext):
    """One mode's figures over every timed query (see the module docstring and docs/benchmarks.md), after the
    run's context."""

    mode: str
    recompute_ratio: float | None
    num_queries: int
    prompt_tokens_mean: float
    cached_tokens_mean: float
    exact_tokens_mean: float
    blend_tokens_mean: float
    recomputed_tokens_mean: float
    skipped_disk_tokens_mean: float
    ttft_ms_mean: float
    ttft_ms_p50: float
    ttft_ms_p90: float
    ttft_ms_p99: float
    ttft_ms_max: float
    speedup_vs_full: float
    lookup_ms_mean: float
    load_ms_mean: float
    load_total_ms_mean: float
    recompute_ms_mean: float
    other_ms_mean: float
    top1_agreement: float | None
    kl_mean: float | None
    continuation_match: float | None
    fact_accuracy: float | None
    fact_accuracy_ci95_low: float | None
    fact_accuracy_ci95_high: float | None
    fact_agreement_with_full: float | None
    fact_full_only: int | None
    fact_mode_only: int | None
    fact_difference_vs_full: float | None
    fact_difference_ci95_low: float | None
    fact_difference_ci95_high: float | None
    baseline: str = "full prefill of the same prompts with the same model, same run"

    def to_json_dict(self) -> dict[str, str | int | float | None]:
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}


def _percentile(values: Sequence[float], ratio: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(ratio * len(ordered)))]


def _mean(values: Sequence[float]) -> float:
    return round(statistics.fmean(values), 3)


def _mean_or_none(values: Sequence[float | bool | None]) -> float | None:
    present = [float(value) for value in values if value is not None]
    return round(statistics.fmean(present), 4) if present else None


@dataclass(frozen=True, slots=True, kw_only=True)
class _FactFields:
    """The fact-accuracy columns of one row (all ``None`` when facts were not asked)."""

    accuracy_ci95_low: float | None = None
    accuracy_ci95_high: float | None = None
    agreement_with_full: float | None = None
    full_only: int | None = None
    mode_only: int | None = None
    difference_vs_full: float | None = None
    difference_ci95_low: float | None = None
    difference_ci95_high: float | None = None


def _fact_fields(samples: Sequence[QuerySample], full_samples: Sequence[QuerySample]) -> _FactFields:
    pairs = [
        (full.fact_correct, sample.fact_correct)
        for full, sample in zip(full_samples, samples, strict=True)
        if full.fact_correct is not None and sample.fact_correct is not None
    ]
    if not pairs:
        return _FactFields()
    full_correct = [full for full, _ in pairs]
    mode_correct = [mode for _, mode in pairs]
    accuracy = wilson_interval(sum(mode_correct), len(mode_correct))
    paired = paired_facts(full_correct, mode_correct)
    return _FactFields(
        accuracy_ci95_low=round(accuracy.low, 4),
        accuracy_ci95_high=round(accuracy.high, 4),
        agreement_with_full=round(paired.agreement_ratio, 4),
        full_only=paired.full_only,
        mode_only=paired.mode_only,
        difference_vs_full=round(paired.difference, 4),
        difference_ci95_low=round(paired.difference_ci95.low, 4),
        difference_ci95_high=round(paired.difference_ci95.high, 4),
    )


def summarize(
    context: RunContext,
    mode: str,
    recompute_ratio: float | None,
    samples: Sequence[QuerySample],
    full_samples: Sequence[QuerySample],
) -> MultiDocRow:
    """The row of one mode from its samples.

    Args:
        context: what every row of the run repeats.
        mode: the mode's name.
        recompute_ratio: the blend ratio of the mode (``None`` for full and prefix).
        samples: the mode's samples, one per query.
        full_samples: full prefill's samples of the same queries in the same order (the TTFT baseline and the
            reference of the paired fact comparison).
    """
    totals = [sample.timings.total_ms for sample in samples]
    full_mean_ms = statistics.fmean(sample.timings.total_ms for sample in full_samples)
    facts = _fact_fields(samples, full_samples)

    def stage(name: str) -> float:
        return _mean([getattr(sample.timings, name) for sample in samples])

    return MultiDocRow(
        **dataclasses.asdict(context),
        mode=mode,
        recompute_ratio=recompute_ratio,
        num_queries=len(samples),
        prompt_tokens_mean=_mean([sample.prompt_tokens for sample in samples]),
        cached_tokens_mean=_mean([sample.exact_tokens + sample.blend_tokens for sample in samples]),
        exact_tokens_mean=_mean([sample.exact_tokens for sample in samples]),
        blend_tokens_mean=_mean([sample.blend_tokens for sample in samples]),
        recomputed_tokens_mean=_mean([sample.recomputed_tokens for sample in samples]),
        skipped_disk_tokens_mean=_mean([sample.skipped_disk_tokens for sample in samples]),
        ttft_ms_mean=_mean(totals),
        ttft_ms_p50=round(statistics.median(totals), 3),
        ttft_ms_p90=round(_percentile(totals, 0.9), 3),
        ttft_ms_p99=round(_percentile(totals, 0.99), 3),
        ttft_ms_max=round(max(totals), 3),
        speedup_vs_full=round(full_mean_ms / statistics.fmean(totals), 3),
        lookup_ms_mean=stage("lookup_ms"),
        load_ms_mean=stage("load_ms"),
        load_total_ms_mean=stage("load_total_ms"),
        recompute_ms_mean=stage("recompute_ms"),
        other_ms_mean=stage("other_ms"),
        top1_agreement=_mean_or_none([sample.top1 for sample in samples]),
        kl_mean=_mean_or_none([sample.kl for sample in samples]),
        continuation_match=_mean_or_none([sample.continuation_match for sample in samples]),
        fact_accuracy=_mean_or_none([sample.fact_correct for sample in samples]),
        fact_accuracy_ci95_low=facts.accuracy_ci95_low,
        fact_accuracy_ci95_high=facts.accuracy_ci95_high,
        fact_agreement_with_full=facts.agreement_with_full,
        fact_full_only=facts.full_only,
        fact_mode_only=facts.mode_only,
        fact_difference_vs_full=facts.difference_vs_full,
        fact_difference_ci95_low=facts.difference_ci95_low,
        fact_difference_ci95_high=facts.difference_ci95_high,
    )
