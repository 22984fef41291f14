"""One record per vLLM request on the connector's scheduler side, its phase explicit, as vLLM's own ``Request`` is.

A request's record holds everything the scheduler side knows of it: the last unpinned probe and the miss account
it offers (until vLLM takes or leaves the hit), the probe behind its last admission, the load or blend pass queued
for or in the workers' hands (with the pin this side still holds for a queued load), its blocks, and what was
loaded, blended and saved. ``RequestPhase`` says where it stands; the phases are ordered as vLLM's
``RequestStatus`` is, so "finished" is a comparison::

    PROBED ──admit──> RUNNING ──queue──> LOAD_QUEUED ──hand over──> LOADING ──report──> RUNNING
                         │     ──queue──> BLEND_QUEUED ─hand over─> BLENDING ──report──> RUNNING
                         └─ preempted ─> PREEMPTED ──admit──> RUNNING
    BLEND_QUEUED | BLENDING ──vLLM finishes it──> FINISHED_AWAITING_BLEND ──report──> (answered, dropped)

A record that never left ``PROBED`` was only looked up: it has no answer (``request_finished`` returns ``None``).
Any other finished request drops its record, except one vLLM finished in the step of its blend pass: its answer is
completed when the pass's report arrives in the same scheduler update.

Single-threaded, as vLLM's scheduler is; the scheduler side owns every record.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvstore.blend.vllm.gate import GateDecision, SpanMakeup
from kvstore.blend.vllm.hook import BlendOutcome
from kvstore.blend.vllm.request_choice import BlendChoice
from kvstore.connectors.vllm.metadata import BlendSpec, LoadSpec
from kvstore.connectors.vllm.request_misses import MissAccount
from kvstore.misses import Miss
from kvstore.plan import LookupPlan, Segment

__all__ = ["HeldPin", "Probe", "RequestPhase", "RequestRecord"]


class RequestPhase(enum.IntEnum):
    """Where a request stands with the connector (the module docstring draws the transitions)."""

    PROBED = enum.auto()  # looked up; vLLM has not admitted it (it has no blocks)
    RUNNING = enum.auto()  # admitted: its blocks are vLLM's, nothing of it is queued or in the workers' hands
    LOAD_QUEUED = enum.auto()  # a load waits for the step's metadata, its plan pinned by this side
    LOADING = enum.auto()  # its load is the workers', until they report it
    BLEND_QUEUED = enum.auto()  # a blend pass waits for the step's metadata
    BLENDING = enum.auto()  # its pass is the workers', until they report it
    PREEMPTED = enum.auto()  # lost its blocks; looked up again when vLLM readmits it
    FINISHED_AWAITING_BLEND = enum.auto()  # finished in its pass's step; the pass's report completes its answer

    @staticmethod
    def is_finished(phase: RequestPhase) -> bool:
        return phase > RequestPhase.PREEMPTED


@dataclass(frozen=True, slots=True, kw_only=True)
class Probe:
    """What the store held for a prompt at an unpinned lookup, and what the scheduler side made of it.

    Args:
        prefix_tokens: the store's exact prefix.
        first_disk_token: the first exact token only the disk tier holds (``None``: none).
        load_async: a load of the hit runs off the step (it comes from the disk).
        segments: the lookup's segments (exact, blend and their tiers).
        misses: the lookup's misses, with their reasons.
        blend_end: the end of a blend span worth a pass (``None``: the exact path).
        choice: the request's blend choice.
        makeup: the blend span's tokens, for the gate to learn from the pass.
        gate: the gate's answer, when it had one.
    """

    prefix_tokens: int
    first_disk_token: int | None
    load_async: bool = False
    segments: tuple[Segment, ...] = ()
    misses: tuple[Miss, ...] = ()
    blend_end: int | None = None
    choice: BlendChoice | None = None
    makeup: SpanMakeup | None = None
    gate: GateDecision | None = None

    @property
    def held_tokens(self) -> int:
        """Where the prompt's own chunks that the store holds end: the exact prefix, less an exact slice at its end
        (rows of a stored chunk that goes on otherwise than the prompt: the prompt's own chunk there is not
        stored, so a save must write it)."""
        last = next((s for s in self.segments if s.exact and s.end == self.prefix_tokens), None)
        return last.start if last is not None and last.is_slice else self.prefix_tokens


@dataclass(frozen=True, slots=True)
class HeldPin:
    """A pinned plan this side took for a queued load, with the client token it was pinned under."""

    plan: LookupPlan
    owner: str


@dataclass(slots=True, kw_only=True)
class RequestRecord:
    """One request's state on the scheduler side (the module docstring); changed only through its methods and by
    the scheduler side that owns it."""

    prompt: tuple[int, ...]
    phase: RequestPhase = RequestPhase.PROBED
    probe: Probe | None = None  # the last unpinned lookup, until vLLM takes or leaves its hit
    offered: MissAccount | None = None  # that lookup's account (or a declined one), until vLLM takes or leaves it
    admitted: Probe | None = None  # the probe behind its last admission
    account: MissAccount | None = None  # its last admission's looked-up tokens and their fate
    transfer: LoadSpec | BlendSpec | None = None  # queued or in the workers' hands (the phase says which)
    pin: HeldPin | None = None  # held until a queued load goes to the workers, which retrieve or release it
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group, as vLLM handed them
    saved: bool = False  # its saves are done (or ended)
    saved_end: int | None = None  # the end of its last step's save while its prefill goes on (a sliding window)
    blended: bool = False  # a blend pass was planned for it: its prompt is not stored (approximate KV)
    loaded_tokens: int = 0
    load_failed_tokens: int = 0
    blend_report: dict[str, object] | None = None
    answer: dict[str, object] | None = None  # the parameters returned when it finished awaiting its blend report

    @property
    def store_prefix_tokens(self) -> int:
        """The store's exact prefix at its last admission (0: none)."""
        return self.admitted.prefix_tokens if self.admitted is not None else 0

    @property
    def store_held_tokens(self) -> int:
        """Where the prompt's own chunks the store held at its last admission end (``Probe.held_tokens``; 0: none)."""
        return self.admitted.held_tokens if self.admitted is not None else 0

    @property
    def planned_load_tokens(self) -> int:
        """The tokens of its load queued or in the workers' hands (0: none)."""
        transfer = self.transfer
        return transfer.end - transfer.start if isinstance(transfer, LoadSpec) else 0

    @property
    def planned_blend(self) -> BlendSpec | None:
        """Its pass queued, in the workers' hands or awaited by its answer (``None``: none)."""
        return self.transfer if isinstance(self.transfer, BlendSpec) else None

    # -- transitions ------------------------------------------------------------------------------------------------

    def admit(self) -> None:
        """vLLM allocated its blocks (first admission, or readmission after a preemption)."""
        if self.phase in (RequestPhase.PROBED, RequestPhase.PREEMPTED):
            self.phase = RequestPhase.RUNNING

    def queue_load(self, spec: LoadSpec, pin: HeldPin | None) -> None:
        self.transfer, self.pin, self.phase = spec, pin, RequestPhase.LOAD_QUEUED

    def queue_blend(self, spec: BlendSpec) -> None:
        self.transfer, self.blended, self.phase = spec, True, RequestPhase.BLEND_QUEUED

    def hand_over(self) -> None:
        """Its queued load or pass went into the step's metadata: the workers have it (and a load's pin) now."""
        if self.phase is RequestPhase.LOAD_QUEUED:
            self.pin, self.phase = None, RequestPhase.LOADING
        elif self.phase is RequestPhase.BLEND_QUEUED:
            self.phase = RequestPhase.BLENDING

    def lose_blocks(self) -> None:
        """Preempted: its load or pass is void (a late report of a load counts what arrived and fails nothing, one
        of a pass is dropped) and its blocks are gone. The caller released its pin first."""
        assert self.pin is None, "the scheduler side releases a preempted request's pin before it forgets its blocks"
        self.transfer, self.block_ids, self.phase = None, [], RequestPhase.PREEMPTED
        self.saved_end = None  # readmitted, it is looked up again: its next save starts from the store's hit

    def finish_load(self, num_loaded: int, reasons: dict[str, int]) -> None:
        """The workers' report of its load: ``num_loaded`` tokens put in place, the rest failed for ``reasons``."""
        planned = self.planned_load_tokens
        num_loaded = min(num_loaded, planned)
        self.loaded_tokens += num_loaded
        self.load_failed_tokens += planned - num_loaded
        if self.account is not None and planned > num_loaded:
            self.account.fail_delivery(planned - num_loaded, reasons)
        if planned:
            self.transfer, self.phase = None, RequestPhase.RUNNING

    def finish_awaiting_blend(self, answer: dict[str, object]) -> None:
        """vLLM finished it in its pass's step (the answer goes out before the pass's report arrives)."""
        self.probe = self.offered = None
        self.answer, self.phase = answer, RequestPhase.FINISHED_AWAITING_BLEND

    def finish_blend(self, spec: BlendSpec, outcome: BlendOutcome | None) -> None:
        """The workers' report of its pass (``None``: it failed and vLLM recomputed the span)."""
        self.transfer = None
        if self.phase is not RequestPhase.FINISHED_AWAITING_BLEND:
            self.phase = RequestPhase.RUNNING
        span_tokens = spec.end - spec.local_end
        if self.account is not None:
            skipped_disk_tokens = None if outcome is None else outcome.skipped_disk_tokens
            self.account.record_blend(spec.local_end, spec.end, skipped_disk_tokens)
        if outcome is None:
            self.load_failed_tokens += span_tokens
            self.blend_report = {"failed": True, "span_tokens": span_tokens, "local_tokens": spec.local_end}
            return
        self.loaded_tokens += span_tokens
        self.blend_report = _blend_report(spec, outcome, len(self.prompt))

    # -- its answer -------------------------------------------------------------------------------------------------

    def transfer_params(self) -> dict[str, object]:
        """What the response's ``kv_transfer_params`` say about this request."""
        report: dict[str, object] = {"loaded_tokens": self.loaded_tokens, "load_failed_tokens": self.load_failed_tokens}
        if self.blend_report is not None:
            report["blend"] = self.blend_report
        admitted = self.admitted
        gate = admitted.gate if admitted is not None else None
        if gate is not None and gate.pass_ms is not None and gate.prefill_ms is not None:
            report["blend_gate"] = {
                "decision": "blend" if gate.blend else "prefill",
                "expected_pass_ms": round(gate.pass_ms, 1),
                "expected_prefill_ms": round(gate.prefill_ms, 1),
            }
        choice = admitted.choice if admitted is not None else None
        if choice is not None and choice.notes:
            report["notes"] = list(choice.notes)
        if self.account is not None:
            report |= self.account.report()
        return {"kvstore": report}


def _blend_report(spec: BlendSpec, outcome: BlendOutcome, prompt_tokens: int) -> dict[str, object]:
    """How a pass served its span, for the response's ``kv_transfer_params["kvstore"]["blend"]``."""
    cached = outcome.exact_tokens + outcome.blend_tokens
    report: dict[str, object] = {
        "span_tokens": spec.end,
        "local_tokens": spec.local_end,
        # recomputed counts the gaps too (computed in every layer): reused is what the selection left cached
        "reused_tokens": max(0, cached - max(0, outcome.recomputed_tokens - outcome.gap_tokens)),
        "exact_tokens": outcome.exact_tokens,
        "blended_tokens": outcome.blend_tokens,
        "gap_tokens": outcome.gap_tokens,
        "recomputed_tokens": outcome.recomputed_tokens,
        "skipped_disk_tokens": outcome.skipped_disk_tokens,
        "computed_by_vllm": prompt_tokens - spec.end,
        "ratio": spec.ratio,
        "blend_ms": round(outcome.blend_ms, 2),
        "load_wait_ms": round(outcome.load_wait_ms, 2),
        "write_ms": round(outcome.write_ms, 2),
    }
    if outcome.selected is not None:
        report["selected"] = list(outcome.selected)
    return report
