"""Wait for the disk or recompute: which is faster for the chunks of a plan that only the disk holds.

On a fast GPU, computing a token's KV is cheaper than reading it from disk (design.md section 7: an 8B model's KV
read at 1.8 GB/s costs 71 us per token, computing it on an H200 35 us); on a CPU it is the other way round. Which
holds depends on the machine, the model and the disk, so a blender learns both rates from its own prefills
(exponentially weighted means; full and prefix prefills teach the compute rate too, and their dense passes cost
less per token-layer than a blend's sparse one, as the skipped tokens would) and decides per prompt, before its
retrieve::

    wait_ms      = bytes still on disk                  x  ms the passes stalled per byte waited for
    recompute_ms = token-layers added by skipping them  x  ms per token-layer the passes computed

Skipping costs nothing later: the store's prefetches keep landing the skipped chunks in the cpu tier, so the next
prompt that uses them loads from memory (``TieredStore.retrieve(memory_only=True)``). Until both rates are known the
blender waits (a prefill that waits teaches the disk rate). ``DiskPolicy`` lets a deployment fix the choice.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.errors import ConfigError
from kvstore.layout import KVLayout
from kvstore.plan import LookupPlan, Segment
from kvstore.tiers.base import TierName

__all__ = ["DiskPolicy", "LoadCostModel", "disk_bound_segments", "skipped_token_layers"]

logger = logging.getLogger(__name__)


class DiskPolicy(enum.StrEnum):
    """What a blend does with the chunks of its plan that only the disk holds when it starts loading."""

    AUTO = "auto"
    """Whichever ``LoadCostModel`` expects to be faster (waits until it has seen both rates)."""
    WAIT = "wait"
    """Always read them (the only choice when recomputing is known to be slower)."""
    RECOMPUTE = "recompute"
    """Never wait for the disk: compute those tokens; the chunks still land in the cpu tier for the next prompt."""


def disk_bound_segments(plan: LookupPlan) -> tuple[Segment, ...]:
    """The segments a retrieve of ``plan`` would read from disk now: disk-resident ones whose prefetch into the cpu
    tier has not landed (a plan from a ``Client`` carries no prefetches: every disk segment counts)."""
    on_disk = tuple(segment for segment in plan.segments if segment.tier is TierName.DISK)
    if len(plan.prefetches) != len(on_disk):
        return on_disk
    return tuple(
        segment for segment, prefetch in zip(on_disk, plan.prefetches, strict=True)
        if not prefetch.done() or prefetch.exception() is not None or not prefetch.result()
    )  # fmt: skip


def skipped_token_layers(
    segments: Sequence[Segment], *, num_layers: int, check_layer: int, recompute_ratio: float
) -> int:
    """Token-layers a pass computes on top when ``segments`` become gaps: a blend token is then computed in every
    layer after the check layer instead of a ``recompute_ratio`` share of them; an exact token in every layer."""
    after_check = max(num_layers - check_layer - 1, 0)
    total = 0.0
    for segment in segments:
        if segment.exact:
            total += segment.num_tokens * num_layers
        else:
            total += segment.num_tokens * (1.0 - recompute_ratio) * after_check
    return round(total)


@dataclass(slots=True)
class LoadCostModel:
    """Running estimates of a blender's disk stall per byte and compute per token-layer.

    Each mean weighs its first observations equally (the n-th by ``1/n``) until ``1/n`` falls below
    ``smoothing``: one odd first prompt (a cold cache, a compile) does not steer the decisions for long.

    Args:
        layout: the store's layout (bytes per token of KV).
        smoothing: weight of the newest observation in each mean once it has seen ``1/smoothing`` of them, in
            ``(0, 1]``.

    Threads: owned by one blender, which prefills one prompt at a time.
    """

    layout: KVLayout
    smoothing: float = 0.3
    ms_per_byte: float | None = None
    ms_per_token_layer: float | None = None
    num_disk_waits: int = 0
    num_computes: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.smoothing <= 1.0:
            raise ConfigError(f"smoothing={self.smoothing!r} must be in (0, 1]")

    def observe_disk_wait(self, num_bytes: int, stall_ms: float) -> None:
        """A pass read ``num_bytes`` from disk and its compute stalled ``stall_ms`` for loaded KV."""
        if num_bytes > 0:
            self.num_disk_waits += 1
            self.ms_per_byte = self._mix(self.ms_per_byte, max(stall_ms, 0.0) / num_bytes, self.num_disk_waits)

    def observe_compute(self, num_token_layers: int, compute_ms: float) -> None:
        """A pass computed ``num_token_layers`` (a token through one layer) in ``compute_ms``."""
        if num_token_layers > 0 and compute_ms > 0.0:
            self.num_computes += 1
            self.ms_per_token_layer = self._mix(self.ms_per_token_layer, compute_ms / num_token_layers,
                                                self.num_computes)  # fmt: skip

    def recompute_is_faster(self, segments: Sequence[Segment], extra_token_layers: int) -> bool:
        """Whether computing ``extra_token_layers`` is expected to take less than reading ``segments`` from disk;
        ``False`` while either rate is unknown."""
        if not segments or self.ms_per_byte is None or self.ms_per_token_layer is None:
            return False
        num_bytes = sum(self.layout.chunk_bytes(segment.num_tokens) for segment in segments)
        wait_ms, recompute_ms = num_bytes * self.ms_per_byte, extra_token_layers * self.ms_per_token_layer
        logger.debug("disk: %d bytes to read, about %.1f ms of stall against %.1f ms to compute %d token-layers",
                     num_bytes, wait_ms, recompute_ms, extra_token_layers)  # fmt: skip
        return recompute_ms < wait_ms

    def _mix(self, mean: float | None, sample: float, count: int) -> float:
        weight = max(self.smoothing, 1.0 / count)
        return sample if mean is None else (1.0 - weight) * mean + weight * sample
