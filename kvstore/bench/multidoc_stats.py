"""How sure a planted-fact accuracy is: a mode's own interval, and its paired difference with full prefill.

Fact accuracy is a proportion over a few dozen or hundred queries, so on its own it is noisy (±10 points at 24
queries). Every mode answers the *same* queries as full prefill, so the comparison that matters is paired: the
queries full prefill answers right and the mode wrong (``full_only``), and the reverse (``mode_only``). Only those
discordant queries carry information about the difference, which is why a paired interval is far narrower than the
two accuracies' intervals side by side::

                       mode right   mode wrong
    full right             a        full_only
    full wrong         mode_only        d            difference = (mode_only - full_only) / n

Intervals are 95%: Wilson's score interval for one accuracy, and Agresti and Min's (2005) for the paired
difference (the Wald interval of McNemar's table after adding 0.5 to each of its four cells, which keeps a sensible
width when there are few or no discordant queries).

Pure functions; thread-safe.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.errors import InvalidInputError

__all__ = ["Interval", "PairedFacts", "paired_facts", "wilson_interval"]

_Z95 = 1.959964


@dataclass(frozen=True, slots=True, kw_only=True)
class Interval:
    """A 95% confidence interval ``[low, high]`` (fractions)."""

    low: float
    high: float


@dataclass(frozen=True, slots=True, kw_only=True)
class PairedFacts:
    """One mode's planted-fact answers against full prefill's on the same queries.

    Args:
        num_queries: queries answered by both.
        agreement_ratio: share of queries where the mode is right exactly when full prefill is.
        full_only: queries full prefill answers right and the mode wrong.
        mode_only: queries the mode answers right and full prefill wrong.
        difference: mode accuracy minus full accuracy, ``(mode_only - full_only) / num_queries``.
        difference_ci95: Agresti-Min 95% interval of ``difference``.
    """

    num_queries: int
    agreement_ratio: float
    full_only: int
    mode_only: int
    difference: float
    difference_ci95: Interval


def wilson_interval(num_correct: int, num_queries: int) -> Interval:
    """Wilson's 95% score interval of an accuracy ``num_correct / num_queries``.

    Raises:
        InvalidInputError: no queries, or more correct answers than queries.
    """
    if num_queries < 1 or not 0 <= num_correct <= num_queries:
        raise InvalidInputError(f"accuracy {num_correct}/{num_queries}: need 0 <= correct <= queries and queries >= 1")
    share = num_correct / num_queries
    z_squared = _Z95 * _Z95
    denominator = 1 + z_squared / num_queries
    centre = (share + z_squared / (2 * num_queries)) / denominator
    half = _Z95 * math.sqrt(share * (1 - share) / num_queries + z_squared / (4 * num_queries**2)) / denominator
    return Interval(low=max(0.0, centre - half), high=min(1.0, centre + half))


def paired_facts(full_correct: Sequence[bool], mode_correct: Sequence[bool]) -> PairedFacts:
    """Compare a mode's answers with full prefill's, query by query (both in the same query order).

    Raises:
        InvalidInputError: the sequences differ in length or are empty.
    """
    if len(full_correct) != len(mode_correct) or not full_correct:
        raise InvalidInputError(
            f"paired answers need the same queries in both modes: {len(full_correct)} full vs {len(mode_correct)}"
        )
    num_queries = len(full_correct)
    full_only = sum(1 for full, mode in zip(full_correct, mode_correct, strict=True) if full and not mode)
    mode_only = sum(1 for full, mode in zip(full_correct, mode_correct, strict=True) if mode and not full)
    # Agresti-Min: 0.5 added to each cell of the 2x2 table, then the Wald interval of the paired difference.
    adjusted_n = num_queries + 2
    adjusted_full_only, adjusted_mode_only = full_only + 0.5, mode_only + 0.5
    centre = (adjusted_mode_only - adjusted_full_only) / adjusted_n
    variance = adjusted_mode_only + adjusted_full_only - (adjusted_mode_only - adjusted_full_only) ** 2 / adjusted_n
    half = _Z95 * math.sqrt(max(variance, 0.0)) / adjusted_n
    return PairedFacts(
        num_queries=num_queries,
        agreement_ratio=(num_queries - full_only - mode_only) / num_queries,
        full_only=full_only,
        mode_only=mode_only,
        difference=(mode_only - full_only) / num_queries,
        difference_ci95=Interval(low=max(-1.0, centre - half), high=min(1.0, centre + half)),
    )
