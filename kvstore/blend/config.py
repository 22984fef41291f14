"""A blended prefill's settings (``BlendConfig``) and their choices, checked without importing torch.

Why a module of its own: ``kvstore bench multi-doc-qa``, ``shuffle`` and ``vllm --blend`` refuse a bad blend
setting (a ratio outside ``[0, 1]``, an unknown selection policy) before torch is imported, and the modules that
use these settings (``layerwise``, ``selection``, ``query_attention``, ``load_cost``) import torch. Each of them
re-exports the names of its settings from here, so that every check is written once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from kvstore.errors import ConfigError

__all__ = [
    "AttentionKernel",
    "BlendConfig",
    "DeviationMetric",
    "DiskPolicy",
    "SelectionPolicy",
    "check_recompute_ratio",
]


class _Device(Protocol):
    """What ``AttentionKernel.resolve`` reads of a ``torch.device`` (this module does not import torch)."""

    @property
    def type(self) -> str: ...


def check_recompute_ratio(ratio: object) -> float:
    """The blend's recompute ratio as a float.

    Raises:
        ConfigError: not a number in ``[0, 1]``.
    """
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0.0 <= ratio <= 1.0:
        raise ConfigError(
            f"recompute_ratio={ratio!r} must be a fraction in [0, 1] (0.15 is CacheBlend's default; 1.0 "
            "recomputes everything, 0 reuses everything)"
        )
    return float(ratio)


class DeviationMetric(enum.StrEnum):
    """What a cached token's deviation is measured on at the check layer.

    ``KEY`` is CacheBlend's (and LMCache's) choice; ``VALUE`` looks at V alone, ``KEY_VALUE`` adds the two (which
    also sees tokens whose attention output changed without their key moving).
    """

    KEY = "key"
    VALUE = "value"
    KEY_VALUE = "key_value"


class SelectionPolicy(enum.StrEnum):
    """How the budget's cached tokens are chosen (``kvstore.blend.selection``'s docstring says how)."""

    KV_DEVIATION = "kv_deviation"
    QUERY_ATTENTION = "query_attention"
    CHUNK_START = "chunk_start"
    CHUNK_START_QUERY_ATTENTION = "chunk_start+query_attention"
    CHUNK_START_KV_DEVIATION = "chunk_start+kv_deviation"

    @property
    def takes_chunk_starts(self) -> bool:
        """Whether the reused spans' first tokens come first in the budget."""
        return self.value.startswith("chunk_start")

    @property
    def scorer(self) -> SelectionPolicy | None:
        """What ranks the rest of the budget: ``KV_DEVIATION``, ``QUERY_ATTENTION`` or nothing."""
        if self in (SelectionPolicy.KV_DEVIATION, SelectionPolicy.CHUNK_START_KV_DEVIATION):
            return SelectionPolicy.KV_DEVIATION
        if self in (SelectionPolicy.QUERY_ATTENTION, SelectionPolicy.CHUNK_START_QUERY_ATTENTION):
            return SelectionPolicy.QUERY_ATTENTION
        return None


class AttentionKernel(enum.StrEnum):
    """The kernel that attends the recomputed tokens (``kvstore.blend.query_attention``)."""

    AUTO = "auto"
    SDPA = "sdpa"
    FLEX = "flex"

    def resolve(self, device: _Device) -> AttentionKernel:
        if self is AttentionKernel.AUTO:
            return AttentionKernel.FLEX if device.type == "cuda" else AttentionKernel.SDPA
        return self


class DiskPolicy(enum.StrEnum):
    """What a blend does with the chunks of its plan that only the disk holds when it starts loading."""

    AUTO = "auto"
    """Whichever ``LoadCostModel`` expects to be faster (waits until it has seen both rates)."""
    WAIT = "wait"
    """Always read them: for a disk known to be faster than the model, or a deployment that wants steady TTFT."""
    RECOMPUTE = "recompute"
    """Never wait for the disk: compute those tokens; the chunks still land in the cpu tier for the next prompt."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BlendConfig:
    """How a blended prefill chooses what to recompute.

    Args:
        recompute_ratio: fraction of the cached (blend) tokens recomputed after the check layer, in ``[0, 1]``;
            CacheBlend's default 0.15. 1.0 reproduces a full prefill, 0 is plain reuse.
        check_layer: the layer (0-based) whose fresh K/V select the tokens; layers up to it compute every
            non-exact token. LMCache's default 1.
        selection: how the ratio's tokens are chosen (``kvstore.blend.selection.SelectionPolicy``): by K/V
            deviation (``kv_deviation``, CacheBlend's), by the attention the computed tokens (the question) pay
            them at the check layer (``query_attention``), the first tokens of every reused span
            (``chunk_start``), or span starts first and the rest by one of the two scorers.
        deviation: what ``kv_deviation`` compares (K alone, or K and V).
        chunk_start_tokens: how many first tokens of every reused span the ``chunk_start`` policies take (within
            the ratio's budget).
        attention: the kernel that attends a subset of the tokens (``query_attention``; ``auto``: flex attention
            on CUDA, one masked sdpa elsewhere).
        num_head_tokens: the first tokens of every reused span (a run of blend segments continuing one cached
            sequence) recomputed after the check layer whatever their deviation, on top of the ratio's share
            (``kvstore.blend.selection.span_head_positions``); only when ``0 < recompute_ratio < 1``, so ratio 0
            stays plain reuse. 0 (the default) turns it off.
        recurring_context_tokens: also recompute, on top of the ratio's share, every reused token whose last this
            many tokens occur as a run earlier in the prompt, before its span (``recurring_context``: what a full
            prefill's prefix-matching attention would read across documents); only when ``0 < recompute_ratio <
            1``. 0 (the default) turns it off.
        stale_key_scale: multiplies, in the attention of this prefill and in the returned decode cache, the keys
            of the cached tokens that keep their cached KV after the check layer (a temperature on their attention
            scores; the question of a blended prompt over-attends to documents cached without the others). The
            stored ``kv`` keeps the cached keys as they are. In ``(0, 1]``; only when ``0 < recompute_ratio < 1``.
            1.0 (the default) turns it off.
        disk_policy: what to do with the plan's chunks that only the disk holds when loading starts
            (``load_cost``): ``auto`` (the default) recomputes their tokens when that is expected to be faster
            than reading them, ``wait`` always reads them, ``recompute`` never waits for the disk. Skipped chunks
            still land in the cpu tier for the next prompt.

    Raises:
        ConfigError: a ratio outside ``[0, 1]``, a negative check layer (the upper bound is checked against the
            model by ``LayerwiseBlender``), an unknown ``selection``, a ``chunk_start_tokens`` below 1, a negative
            ``num_head_tokens`` or ``recurring_context_tokens``, or a ``stale_key_scale`` outside ``(0, 1]``.
    """

    recompute_ratio: float = 0.15
    check_layer: int = 1
    selection: SelectionPolicy = SelectionPolicy.KV_DEVIATION
    deviation: DeviationMetric = DeviationMetric.KEY
    chunk_start_tokens: int = 4
    attention: AttentionKernel = AttentionKernel.AUTO
    num_head_tokens: int = 0
    recurring_context_tokens: int = 0
    stale_key_scale: float = 1.0
    disk_policy: DiskPolicy = DiskPolicy.AUTO

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute_ratio", check_recompute_ratio(self.recompute_ratio))
        layer = self.check_layer
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ConfigError(f"check_layer={layer!r} must be a layer index >= 0 (default 1)")
        choices: tuple[tuple[str, type[enum.StrEnum]], ...] = (
            ("selection", SelectionPolicy),
            ("deviation", DeviationMetric),
            ("attention", AttentionKernel),
            ("disk_policy", DiskPolicy),
        )
        for name, kind in choices:
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, kind(value))
            except ValueError:
                raise ConfigError(f"{name}={value!r} is not one of {', '.join(item.value for item in kind)}") from None
        starts = self.chunk_start_tokens
        if isinstance(starts, bool) or not isinstance(starts, int) or starts < 1:
            raise ConfigError(f"chunk_start_tokens={starts!r} must be a token count >= 1 (default 4)")
        for name in ("num_head_tokens", "recurring_context_tokens"):
            count = getattr(self, name)
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ConfigError(f"{name}={count!r} must be a token count >= 0 (0 turns it off)")
        scale = self.stale_key_scale
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not 0.0 < scale <= 1.0:
            raise ConfigError(f"stale_key_scale={scale!r} must be in (0, 1] (1.0 turns it off)")
        object.__setattr__(self, "stale_key_scale", float(scale))
