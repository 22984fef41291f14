"""How much slower one deployment is than another, from requests measured in pairs, with a confidence interval.

Two deployments measured one after the other on a shared 2-core machine differ by more than a few percent for reasons
that have nothing to do with them (another job, the VM's memory balloon, the CPU's clock). Measured interleaved, each
prompt sent to both one after the other, the drift cancels in each pair: the ratio of the pair's times. The estimate
is the geometric mean of the pairs' ratios (a ratio of 1.1 and one of 1/1.1 average to 1), and its 95% interval a
percentile bootstrap of that mean (seeded: the same samples give the same interval), so a 2% difference can be told
from noise once there are enough pairs.

Pairs measured under a few fixed conditions, in numbers the design fixes (an interleaved pair run once with each
server started first: the order shifts every ratio of its run one way), are *strata*: the bootstrap resamples each
stratum within itself, so a difference between strata, which the design balances out of the mean, stays out of the
interval too.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.errors import InvalidInputError

__all__ = ["PairedRatio", "paired_ratio"]

BOOTSTRAP_SAMPLES = 4000


@dataclass(frozen=True, slots=True, kw_only=True)
class PairedRatio:
    """``measured / reference`` over the pairs: its geometric mean and a 95% interval of it."""

    ratio: float
    low: float
    high: float
    pairs: int


def paired_ratio(
    reference: Sequence[float], measured: Sequence[float], *, strata: Sequence[int] | None = None, seed: int = 0
) -> PairedRatio:
    """The geometric-mean ratio ``measured[i] / reference[i]`` with its bootstrap 95% interval.

    Args:
        strata: each pair's stratum (``None``: one); the bootstrap resamples within each.

    Raises:
        InvalidInputError: the sequences differ in length, are empty, or hold a time that is not positive.
    """
    if len(reference) != len(measured) or not reference or (strata is not None and len(strata) != len(reference)):
        raise InvalidInputError(f"{len(reference)} reference and {len(measured)} measured times: give equal, non-zero")
    if min(*reference, *measured) <= 0:
        raise InvalidInputError("every paired time must be positive")
    logs = [math.log(after / before) for before, after in zip(reference, measured, strict=True)]
    groups: dict[int, list[float]] = {}
    for stratum, log in zip(strata or [0] * len(logs), logs, strict=True):
        groups.setdefault(stratum, []).append(log)
    rng = random.Random(seed)
    means = sorted(
        sum(math.fsum(rng.choices(group, k=len(group))) for group in groups.values()) / len(logs)
        for _ in range(BOOTSTRAP_SAMPLES)
    )
    low, high = means[int(0.025 * BOOTSTRAP_SAMPLES)], means[int(0.975 * BOOTSTRAP_SAMPLES) - 1]
    return PairedRatio(ratio=math.exp(statistics.fmean(logs)), low=math.exp(low), high=math.exp(high), pairs=len(logs))
