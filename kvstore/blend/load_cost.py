"""Wait for the disk or recompute: which is faster for the chunks of a plan that only the disk holds.

On a fast GPU, computing a token's KV is cheaper than reading it from disk (measured:
docs/design-notes.md#blend-load-cost); on a CPU it is the other way round. Which holds depends on the machine, the model
and the disk, so a blender learns both rates from its own prefills (running medians; full and prefix prefills teach the
compute rate too, and their dense passes cost less per token-layer than a blend's sparse one, as the skipped tokens
would) and decides per prompt, before its retrieve::

    wait_ms      = bytes still on disk                  x  ms the passes stalled per byte waited for
    recompute_ms = token-layers added by skipping them  x  ms per token-layer the passes computed

Skipping costs nothing later: the store's prefetches keep landing the skipped chunks in the cpu tier, so the next
prompt that uses them loads from memory (``TieredStore.retrieve(memory_only=True)``). Until both rates are known the
blender waits (a prefill that waits teaches the disk rate). ``DiskPolicy`` lets a deployment fix the choice.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Sequence

from kvstore.blend.config import DiskPolicy
from kvstore.errors import ConfigError
from kvstore.layout import KVLayout
from kvstore.plan import LookupPlan, Segment
from kvstore.tiers.base import TierName

__all__ = ["DiskPolicy", "LoadCostModel", "disk_bound_segments", "skipped_token_layers"]

logger = logging.getLogger(__name__)


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


class LoadCostModel:
    """Running estimates of a blender's disk stall per byte and compute per token-layer: the median of each rate's
    last ``window`` observations, so the odd prompt (the first one's kernel compiles and cold caches, a neighbour's
    burst) moves neither estimate, while a lasting change does within half a window.

    Args:
        layout: the store's layout (bytes per token of KV).
        window: observations each median covers (at least 1).

    Threads: owned by one blender, which prefills one prompt at a time.
    """

    def __init__(self, layout: KVLayout, window: int = 8) -> None:
        if window < 1:
            raise ConfigError(f"window={window!r} must be at least 1 observation")
        self.layout = layout
        self._disk_ms_per_byte: deque[float] = deque(maxlen=window)
        self._compute_ms_per_token_layer: deque[float] = deque(maxlen=window)

    @property
    def ms_per_byte(self) -> float | None:
        """Compute stall per byte read from disk (``None`` until a pass has waited for the disk)."""
        return statistics.median(self._disk_ms_per_byte) if self._disk_ms_per_byte else None

    @property
    def ms_per_token_layer(self) -> float | None:
        """Compute time per token through one layer (``None`` until a prefill has run)."""
        return statistics.median(self._compute_ms_per_token_layer) if self._compute_ms_per_token_layer else None

    def observe_disk_wait(self, num_bytes: int, stall_ms: float) -> None:
        """A pass read ``num_bytes`` from disk and its compute stalled ``stall_ms`` for loaded KV."""
        if num_bytes > 0:
            self._disk_ms_per_byte.append(max(stall_ms, 0.0) / num_bytes)

    def observe_compute(self, num_token_layers: int, compute_ms: float) -> None:
        """A pass computed ``num_token_layers`` (a token through one layer) in ``compute_ms``."""
        if num_token_layers > 0 and compute_ms > 0.0:
            self._compute_ms_per_token_layer.append(compute_ms / num_token_layers)

    def recompute_is_faster(self, segments: Sequence[Segment], extra_token_layers: int) -> bool:
        """Whether computing ``extra_token_layers`` is expected to take less than reading ``segments`` from disk;
        ``False`` while either rate is unknown."""
        ms_per_byte, ms_per_token_layer = self.ms_per_byte, self.ms_per_token_layer
        if not segments or ms_per_byte is None or ms_per_token_layer is None:
            return False
        num_bytes = sum(self.layout.chunk_bytes(segment.stored_tokens) for segment in segments)  # a slice's whole chunk
        wait_ms, recompute_ms = num_bytes * ms_per_byte, extra_token_layers * ms_per_token_layer
        logger.debug("disk: %d bytes to read, about %.1f ms of stall against %.1f ms to compute %d token-layers",
                     num_bytes, wait_ms, recompute_ms, extra_token_layers)  # fmt: skip
        return recompute_ms < wait_ms
