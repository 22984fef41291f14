"""What the scheduler-side connector tells the workers each step, what they tell it back, and the stats they keep.

Everything here crosses a process boundary (vLLM pickles it from EngineCore to the workers and back), so it is
plain data: token ids as tuples, block ids as tuples, no tensors and no handles.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvstore.blend.vllm.hook import BlendOutcome
from kvstore.plan import LookupPlan

__all__ = [
    "MISSED_PREFIX",
    "UNSAVED_PREFIX",
    "BlendSpec",
    "KVStoreConnectorMetadata",
    "KVStoreConnectorStats",
    "KVStoreWorkerMetadata",
    "LoadSpec",
    "SaveSpec",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadSpec:
    """Load tokens ``[start, end)`` of a request's prompt from the store into its blocks.

    Args:
        request_id: vLLM's request id.
        token_ids: the whole prompt (looked up whole: its last chunk may be stored partial, and a lookup of a
            shorter prefix would not match it).
        block_ids: the blocks that receive tokens ``[start, end)``, in order (``(end - start) / block_size``).
        start: the first token to load (vLLM's own block-aligned hit).
        end: one past the last token to load (block-aligned).
        is_async: load off the step; the worker reports completion through ``get_finished``.
        plan: the scheduler's pinned plan of the prompt, handed over: the worker retrieves (or releases) it instead
            of looking the prompt up again; ``None``: the worker looks it up itself.
        plan_owner: the scheduler's ``client_token``, which lets the worker's client retrieve that plan.
        readers: the workers (ranks) that each retrieve or release the plan: the server keeps it pinned until all
            have (a tensor- or pipeline-parallel engine's ranks each load their part of it).
        other_groups: with several KV cache groups (vLLM's hybrid manager), the blocks of groups 1, 2, ... for the
            same tokens (``block_ids`` are group 0's); a sliding-window group's blocks outside the window are the
            null block (``kv_groups.NULL_BLOCK_ID``), which receives nothing.
    """

    request_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    start: int
    end: int
    is_async: bool
    plan: LookupPlan | None = None
    plan_owner: str | None = None
    readers: int = 1
    other_groups: tuple[tuple[int, ...], ...] = ()

    @property
    def group_block_ids(self) -> tuple[tuple[int, ...], ...]:
        """Every group's blocks for tokens ``[start, end)``, in vLLM's group order."""
        return (self.block_ids, *self.other_groups)


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveSpec:
    """Store the KV of prompt tokens ``[start, end)`` once this step has computed the last of them.

    Args:
        request_id: vLLM's request id.
        token_ids: the prompt up to ``end``.
        block_ids: the blocks holding tokens ``[start, end)``, in order (the last may be partly used).
        start: the first token of the block holding the end of the store's hit (the store writes the chunks that
            begin at or after it; its cut need not fall on blocks), or of a step's save of a prompt whose prefill
            runs over several steps (``prompt_saves``: a sliding window frees blocks before the prefill ends).
        end: the prompt's length, or the tokens computed by the end of the step (``token_ids`` are the prompt's first
            ``end``: a prefix's chunks are the prompt's, but its last may be partial, stored under its own tokens).
        other_groups: with several KV cache groups, the blocks of groups 1, 2, ... for the same tokens
            (``block_ids`` are group 0's); never the null block (the scheduler saves only blocks vLLM holds).
    """

    request_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    start: int
    end: int
    other_groups: tuple[tuple[int, ...], ...] = ()

    @property
    def group_block_ids(self) -> tuple[tuple[int, ...], ...]:
        """Every group's blocks for tokens ``[start, end)``, in vLLM's group order."""
        return (self.block_ids, *self.other_groups)


@dataclass(frozen=True, slots=True, kw_only=True)
class BlendSpec:
    """Blend tokens ``[0, end)`` of a request's prompt and write ``[local_end, end)`` into its blocks, before the
    step's forward computes ``[end, T)`` (``kvstore.blend.vllm.span``).

    Args:
        request_id: vLLM's request id.
        token_ids: the whole prompt (looked up whole, so chunks running past ``end`` still match).
        block_ids: the blocks that receive tokens ``[local_end, end)``, in order.
        local_end: vLLM's own prefix-cache hit (block-aligned); its blocks may be shared and are never written.
        end: one past the last token the pass computes (block-aligned).
        ratio: the request's recompute ratio.
        report_selection: return the recomputed positions.
    """

    request_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    local_end: int
    end: int
    ratio: float
    report_selection: bool = False


@dataclass(slots=True)
class KVStoreConnectorMetadata(KVConnectorMetadata):
    """One step's work for the workers."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    blends: list[BlendSpec] = field(default_factory=list)
    step_tokens: int = 0  # tokens the step computes (the worker times steps without loads or passes)


@dataclass(slots=True)
class KVStoreWorkerMetadata(KVConnectorWorkerMetadata):
    """What a worker finished this step: loads whose data is in the blocks (or failed), and how many tokens each
    put there, so the scheduler side can drop the pins it took when it planned them and tell a load that fell short
    (vLLM recomputes it) from one that did not.

    Args:
        finished_loads: request id -> tokens its load put into the blocks (fewer than planned: the rest failed).
        finished_blends: request id -> how its blend pass served it (``None``: the pass failed and vLLM recomputes
            its blocks).
        prefill_steps: ``(ms, tokens)`` of forward steps without loads or passes: the engine's own prefill rate,
            which the blend gate weighs a pass against.
        load_misses: request id -> why its load fell short: tokens by miss reason (``kvstore.misses``), as far as
            the retrieve named them.
    """

    finished_loads: dict[str, int] = field(default_factory=dict)
    finished_blends: dict[str, BlendOutcome | None] = field(default_factory=dict)
    prefill_steps: list[tuple[float, int]] = field(default_factory=list)
    load_misses: dict[str, dict[str, int]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Merge two workers' reports: a load counts only as far as every worker got, a blend only if every
        worker's pass succeeded (a parallel engine's ranks report in the same step; blending runs on one worker)."""
        assert isinstance(other, KVStoreWorkerMetadata), f"cannot aggregate {type(other).__name__}"
        merged = dict(self.finished_loads)
        for request_id, num_tokens in other.finished_loads.items():
            merged[request_id] = min(num_tokens, merged.get(request_id, num_tokens))
        blends = dict(self.finished_blends)
        for request_id, outcome in other.finished_blends.items():
            blends[request_id] = outcome if blends.get(request_id, outcome) is not None else None
        steps = self.prefill_steps or other.prefill_steps  # every worker ran the same steps
        misses = self.load_misses | other.load_misses
        return KVStoreWorkerMetadata(
            finished_loads=merged, finished_blends=blends, prefill_steps=steps, load_misses=misses
        )


_COUNTERS = (
    "blends",
    "blended_tokens",
    "blend_recomputed_tokens",
    "blend_failed",
    "loads",
    "loaded_tokens",
    "loaded_bytes",
    "load_failed_blocks",
    "saves",
    "saved_tokens",
    "saved_bytes",
)
_SECONDS = ("load_seconds", "save_seconds", "blend_seconds", "on_path_seconds")


MISSED_PREFIX = "missed_"
"""The stats' missed tokens of one reason are ``missed_<reason>``."""

UNSAVED_PREFIX = "unsaved_"
"""The stats' prompt tokens not stored for one reason are ``unsaved_<reason>`` (``sliding_window``: vLLM freed a
block of a sliding-window group before the chunk holding it was complete)."""

STALL_REPORT_S = 0.05
"""Engine-path time in one reporting interval that is worth a stats line even without a transfer."""


@dataclass
class KVStoreConnectorStats(KVConnectorStats):
    """The worker's transfer counters since the last report (vLLM logs ``reduce()`` every logging interval);
    ``on_path_ms`` is the time the engine's thread spent inside the connector's hooks (``HookClock``). The
    scheduler's side adds the finished requests' ``looked_up_tokens`` and ``missed_<reason>`` tokens
    (docs/miss-reasons.md), which vLLM aggregates with the workers'."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {name: 0 for name in _COUNTERS} | {name: 0.0 for name in _SECONDS}

    def record(self, **amounts: float) -> None:
        for name, amount in amounts.items():
            self.data[name] = self.data.get(name, 0) + amount

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, amount in other.data.items():
            self.data[name] = self.data.get(name, 0) + amount
        return self

    def reduce(self) -> dict[str, int | float]:
        data: dict[str, Any] = self.data
        reduced: dict[str, int | float] = {name: data.get(name, 0) for name in _COUNTERS}
        reduced["load_ms_mean"] = round(1000 * data.get("load_seconds", 0.0) / max(data.get("loads", 0), 1), 2)
        reduced["save_ms_mean"] = round(1000 * data.get("save_seconds", 0.0) / max(data.get("saves", 0), 1), 2)
        reduced["blend_ms_mean"] = round(1000 * data.get("blend_seconds", 0.0) / max(data.get("blends", 0), 1), 2)
        reduced["on_path_ms"] = round(1000 * data.get("on_path_seconds", 0.0), 2)
        reduced["looked_up_tokens"] = data.get("looked_up_tokens", 0)
        reduced |= {
            name: count
            for name, count in sorted(data.items())
            if name.startswith((MISSED_PREFIX, UNSAVED_PREFIX)) and count
        }
        return reduced

    def is_empty(self) -> bool:
        """Nothing to report: no transfer, and no more than ``STALL_REPORT_S`` on the engine's path (a stall on a
        store in trouble is reported even when nothing was loaded or saved; the hooks' own microseconds are not)."""
        reported = ("loads", "saves", "blends", "blend_failed", "looked_up_tokens")
        transfers = any(self.data.get(name) for name in reported)
        return not transfers and self.data.get("on_path_seconds", 0.0) < STALL_REPORT_S
