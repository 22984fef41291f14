"""A benchmark row's missed tokens by reason, summed from its requests' connector reports (docs/miss-reasons.md).

A row shows how many prompt tokens its requests looked up in the store (past vLLM's own prefix-cache hit), how many
of them were missed, and the reasons; ``reasons_share`` is the share of the missed tokens the reasons account for,
which the connector makes 1.0 by construction (a row where it is not is a bug, and the benchmark says so).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvstore.bench.vllm_engine import RequestResult

__all__ = ["MissTally", "tally_misses"]


@dataclass(frozen=True, slots=True, kw_only=True)
class MissTally:
    """Requests' looked-up and missed tokens, and the missed ones by reason."""

    looked_up_tokens: int = 0
    missed_tokens: int = 0
    reasons: dict[str, int] = field(default_factory=dict)

    @property
    def reasons_share(self) -> float | None:
        """The share of missed tokens the reasons account for (``None``: nothing missed)."""
        return sum(self.reasons.values()) / self.missed_tokens if self.missed_tokens else None

    def to_json_dict(self) -> dict[str, object]:
        share = self.reasons_share
        return {
            "looked_up_tokens": self.looked_up_tokens,
            "missed_tokens": self.missed_tokens,
            "miss_reasons": dict(self.reasons),
            "miss_reasons_share": None if share is None else round(share, 6),
        }

    def describe(self) -> str:
        """``missed/looked up``, then the reasons with the most tokens first."""
        if not self.looked_up_tokens:
            return "-"
        reasons = ", ".join(f"{reason} {count:,}" for reason, count in Counter(self.reasons).most_common())
        return f"{self.missed_tokens:,}/{self.looked_up_tokens:,}" + (f": {reasons}" if reasons else "")


def tally_misses(results: Iterable[RequestResult]) -> MissTally:
    """Sum the connector's reports of ``results`` (requests without one add nothing)."""
    looked_up = missed = 0
    reasons: Counter[str] = Counter()
    for result in results:
        report = result.kvstore_report
        looked_up += int(report.get("looked_up_tokens", 0))
        missed += int(report.get("missed_tokens", 0))
        reasons.update({str(reason): int(count) for reason, count in report.get("miss_reasons", {}).items()})
    return MissTally(looked_up_tokens=looked_up, missed_tokens=missed, reasons=dict(reasons))
