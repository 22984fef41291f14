"""The connector's scheduler half (vLLM's EngineCore process): how much of a prompt the store can give, the pins that
keep it there until the workers have loaded it, and when a prompt's KV is complete enough to store.

Per request::

    get_num_new_matched_tokens   lookup without pins (one round trip): side-effect free, may repeat
    update_state_after_alloc     the hit is taken: look up again *pinned*, queue a LoadSpec for the workers that
                                 carries the pinned plan and this side's client token
    build_connector_meta         hand queued loads to the workers, their plans with them (the worker retrieves the
                                 plan under the token, or releases it: a load is 3 round trips, probe, pinned
                                 lookup, retrieve); once a step completes the prefill, a SaveSpec for the chunks
                                 the store lacks
    update_connector_output      the workers report finished loads (and how many tokens each put in place); a load
                                 that fell short marks the request, which is then never offered a hit again (vLLM
                                 recomputes it, instead of retrying a load that keeps failing)
    request_finished / preempt   drop whatever is still pinned or queued; the response's ``kv_transfer_params``
                                 say what was loaded: ``{"kvstore": {"loaded_tokens": N, "load_failed_tokens": M}}``

Saves are asynchronous: a prompt is in the store some milliseconds after its prefill step (longer on a busy host),
so an identical prompt arriving in between misses (vLLM's own prefix cache serves that case within one engine).
The scheduler does not wait for saves: vLLM has no way to park a request without spinning its step loop.

Roles (``kv_role``): ``kv_consumer`` (a decode engine) loads and never saves; ``kv_producer`` (a prefill engine)
never loads and looks a prompt up only so that its save skips the chunks the store holds. A producer's workers wait
for their saves within the step (``WorkerSide``'s ``wait_for_saves``), so its answer to a request means the prompt is
in the store: a prefill/decode proxy sends the request on to the decode engine the moment prefill answers.

vLLM accepts only a contiguous external prefix, so the hit is the store's exact prefix (with segmented prefix on
the server, only its gap-free start counts), cut down to a block boundary and never the whole prompt (vLLM must
compute at least the last token). A hit that must come from the disk tier is loaded asynchronously (the request
waits in ``WAITING_FOR_REMOTE_KVS`` while other requests run), unless ``kvstore.async_disk_loads`` is off.

Blending (``kvstore.blend``, per request ``kvstore.blend.vllm.request_choice``): the probe is a content lookup
(``lookup(blend=True)``), and when the prompt holds cached chunks past its exact prefix the whole span up to the last
cached block (``kvstore.blend.vllm.span``) is reported as external tokens, loaded synchronously: the worker's blend pass
computes it (gaps included) before the step's forward. At most ``kvstore.blend_passes_per_step`` passes go into one step
(every request decoding in it waits for them); a request over that answers ``None`` ("ask again"), and vLLM keeps it
waiting for a later step. No pin is taken: the pass looks the prompt up itself, and a chunk evicted in between is one
more gap it computes. The response's ``kv_transfer_params["kvstore"]["blend"]`` says how the span was served
(``reused_tokens``, ``recomputed_tokens``, ...). A blended prompt is not stored: its KV is approximate (a later prompt
with the same prefix would take it as exact) and its documents are stored already (storing it would keep a near-copy of
every document it holds under a new prefix). A request that finishes in its blend step (one new token) is answered
before the worker's report comes back in the same scheduler update, so its report is filled into the answer's parameters
then (vLLM sends the answer after the update).

Single-threaded, as vLLM's scheduler is.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.v1.request import RequestStatus

from kvstore.blend.vllm.gate import BlendGate, GateDecision, SpanMakeup, span_makeup
from kvstore.blend.vllm.hook import BlendOutcome
from kvstore.blend.vllm.request_choice import BlendChoice, blend_choice
from kvstore.blend.vllm.span import blend_span_end
from kvstore.client import Client
from kvstore.connectors.settings import ConnectorSettings
from kvstore.connectors.store_link import StoreLink
from kvstore.connectors.vllm.hit_sources import tokens_by_tier
from kvstore.connectors.vllm.metadata import (
    MISSED_PREFIX,
    BlendSpec,
    KVStoreConnectorMetadata,
    KVStoreConnectorStats,
    KVStoreWorkerMetadata,
    LoadSpec,
    SaveSpec,
)
from kvstore.connectors.vllm.request_misses import cached_tokens, request_misses
from kvstore.misses import Miss, MissReason
from kvstore.plan import LookupPlan, Segment
from kvstore.tiers.base import TierName

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["SchedulerSide"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Probe:
    """What the store held for a prompt at the last unpinned lookup."""

    prefix_tokens: int
    first_disk_token: int | None
    load_async: bool = False
    segments: tuple[Segment, ...] = ()
    misses: tuple[Miss, ...] = ()
    blend_end: int | None = None  # the end of a blend span worth a pass (None: the exact path)
    choice: BlendChoice | None = None
    makeup: SpanMakeup | None = None  # the blend span's tokens, for the gate to learn from the pass
    gate: GateDecision | None = None  # the gate's answer when it had one


@dataclass(slots=True, kw_only=True)
class _MissAccount:
    """What a request's last admission looked up and what became of it, for its miss reasons
    (``request_misses``'s arguments)."""

    segments: tuple[Segment, ...]
    misses: tuple[Miss, ...]
    local_end: int
    num_tokens: int
    exact_end: int
    gate_refused: bool = False
    declined: MissReason | None = None
    served_end: int = 0
    undelivered: Counter[MissReason] = field(default_factory=Counter)

    def report(self) -> dict[str, object]:
        missed = request_misses(
            self.segments, self.misses, local_end=self.local_end, num_tokens=self.num_tokens,
            served_end=self.served_end, exact_end=self.exact_end, gate_refused=self.gate_refused,
            declined=self.declined, undelivered=self.undelivered,
        )  # fmt: skip
        return {
            "looked_up_tokens": self.num_tokens - self.local_end,
            "missed_tokens": sum(missed.values()),
            "miss_reasons": {reason.value: count for reason, count in missed.most_common()},
        }

    def fail_delivery(self, num_tokens: int, reasons: dict[str, int]) -> None:
        """``num_tokens`` of the served span were not delivered: under the worker's ``reasons`` as far as they go,
        the rest ``load_failed`` (a failed call, a block cut short)."""
        for name, count in reasons.items():
            taken = min(count, num_tokens)
            self.undelivered[MissReason(name)] += taken
            num_tokens -= taken
        if num_tokens:
            self.undelivered[MissReason.LOAD_FAILED] += num_tokens


def _declined(prompt_tokens: int, local_end: int, previous: _MissAccount | None = None) -> _MissAccount:
    """The account of a request the connector did not look up: what its ``previous`` probe cached is
    ``load_failed`` (a load of it failed before, and it is not retried), the rest keeps its store reasons; without
    one (the store unreachable) every looked-up token is ``load_failed``."""
    if previous is not None:
        return dataclasses.replace(
            previous, local_end=local_end, served_end=local_end, declined=MissReason.LOAD_FAILED, undelivered=Counter()
        )
    miss = Miss(0, prompt_tokens, MissReason.LOAD_FAILED)
    return _MissAccount(segments=(), misses=(miss,), local_end=local_end, num_tokens=prompt_tokens, exact_end=0)


@dataclass(slots=True, kw_only=True)
class _Tracked:
    """A request the connector loads for or will store."""

    prompt: tuple[int, ...]
    block_ids: list[int] = field(default_factory=list)
    store_prefix_tokens: int = 0
    saved: bool = False
    pinned: LookupPlan | None = None  # until its load goes to the worker, which retrieves or releases it
    pin_owner: str | None = None  # the scheduler's client token the plan was pinned under
    planned_load_tokens: int = 0  # the load queued or in flight (0: none)
    loaded_tokens: int = 0
    load_failed_tokens: int = 0
    choice: BlendChoice | None = None
    planned_blend: BlendSpec | None = None  # queued or in the worker, until its outcome comes back
    blended: bool = False  # a blend pass was planned for it: its prompt is not stored (approximate KV)
    blend: dict[str, object] | None = None
    makeup: SpanMakeup | None = None  # its planned pass's span
    gate: GateDecision | None = None
    planned_segments: tuple[Segment, ...] = ()  # the probe's segments of the load or blend just planned
    account: _MissAccount | None = None  # its last admission's looked-up tokens and their fate

    def transfer_params(self) -> dict[str, object]:
        """What the response's ``kv_transfer_params`` say about this request."""
        report: dict[str, object] = {"loaded_tokens": self.loaded_tokens, "load_failed_tokens": self.load_failed_tokens}
        if self.blend is not None:
            report["blend"] = self.blend
        gate = self.gate
        if gate is not None and gate.pass_ms is not None and gate.prefill_ms is not None:
            report["blend_gate"] = {
                "decision": "blend" if gate.blend else "prefill",
                "expected_pass_ms": round(gate.pass_ms, 1),
                "expected_prefill_ms": round(gate.prefill_ms, 1),
            }
        if self.choice is not None and self.choice.notes:
            report["notes"] = list(self.choice.notes)
        if self.account is not None:
            report |= self.account.report()
        return {"kvstore": report}

    def record_blend(self, spec: BlendSpec, outcome: BlendOutcome | None) -> None:
        """The worker's report of the request's blend pass (``None``: it failed and vLLM recomputed the span)."""
        self.planned_blend = None
        span_tokens = spec.end - spec.local_end
        account = self.account
        if account is not None:
            cached = cached_tokens(account.segments, spec.local_end, spec.end)
            if outcome is None:
                account.undelivered[MissReason.LOAD_FAILED] += cached
            elif outcome.skipped_disk_tokens:
                account.undelivered[MissReason.DISK_SLOWER] += min(cached, outcome.skipped_disk_tokens)
        if outcome is None:
            self.load_failed_tokens += span_tokens
            self.blend = {"failed": True, "span_tokens": span_tokens, "local_tokens": spec.local_end}
            return
        self.loaded_tokens += span_tokens
        cached = outcome.exact_tokens + outcome.blend_tokens
        self.blend = {
            "span_tokens": spec.end,
            "local_tokens": spec.local_end,
            # recomputed counts the gaps too (computed in every layer): reused is what the selection left cached
            "reused_tokens": max(0, cached - max(0, outcome.recomputed_tokens - outcome.gap_tokens)),
            "exact_tokens": outcome.exact_tokens,
            "blended_tokens": outcome.blend_tokens,
            "gap_tokens": outcome.gap_tokens,
            "recomputed_tokens": outcome.recomputed_tokens,
            "skipped_disk_tokens": outcome.skipped_disk_tokens,
            "computed_by_vllm": len(self.prompt) - spec.end,
            "ratio": spec.ratio,
            "blend_ms": round(outcome.blend_ms, 2),
            "load_wait_ms": round(outcome.load_wait_ms, 2),
            "write_ms": round(outcome.write_ms, 2),
        }
        if outcome.selected is not None:
            self.blend["selected"] = list(outcome.selected)


class SchedulerSide:
    """The scheduler half of ``KVStoreConnector``.

    Args:
        link: the scheduler process's link to the store.
        block_size: vLLM's block size (tokens per block).
        load: whether this engine loads from the store (role ``kv_consumer`` or ``kv_both``).
        save: whether this engine stores prompts (role ``kv_producer`` or ``kv_both``).
        async_disk_loads: load disk hits asynchronously.
        settings: the connector's settings (blending and its defaults); the default blends nothing.
        num_layers: the model's layers (what the blend gate weighs a pass's early layers by).
        readers: the engine's workers (tensor x pipeline parallel ranks), each of which retrieves a handed plan.
    """

    def __init__(
        self,
        link: StoreLink,
        *,
        block_size: int,
        load: bool,
        save: bool,
        async_disk_loads: bool,
        settings: ConnectorSettings | None = None,
        num_layers: int = 1,
        readers: int = 1,
    ) -> None:
        self._link = link
        self._settings = settings or ConnectorSettings()
        self._gate = BlendGate(num_layers=num_layers, check_layer=self._settings.blend_check_layer)
        self._readers = readers
        self._block_size = block_size
        self._load = load
        self._save = save
        self._async_disk_loads = async_disk_loads
        self._probes: dict[str, _Probe] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._queued_loads: dict[str, LoadSpec] = {}
        self._queued_blends: dict[str, BlendSpec] = {}
        self._answered: dict[str, dict[str, object]] = {}  # finished before their blend report came back
        self._accounts: dict[str, _MissAccount] = {}  # the last probe's, until vLLM takes or leaves its hit
        self._stats = KVStoreConnectorStats()  # finished requests' looked-up and missed tokens

    # -- vLLM's scheduler hooks ---------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        prompt = tuple(request.prompt_token_ids or ())
        if len(prompt) <= self._block_size:
            return 0, False
        if not self._load:
            self._probe_for_save(request.request_id, prompt)
            return 0, False
        tracked = self._tracked.get(request.request_id)
        if tracked is not None and tracked.load_failed_tokens:
            self._accounts[request.request_id] = _declined(len(prompt), num_computed_tokens, tracked.account)
            return 0, False  # its load fell short once: vLLM recomputes rather than retry a store that failed it
        choice = blend_choice(self._settings, request.kv_transfer_params) if self._settings.blend else None
        blend = choice is not None and choice.enabled
        probe = self._link.call("lookup", lambda client: _probe(client, prompt, blend=blend))
        if probe is None:
            self._probes.pop(request.request_id, None)
            self._accounts[request.request_id] = _declined(len(prompt), num_computed_tokens)
            return 0, False
        account = _MissAccount(
            segments=probe.segments,
            misses=probe.misses,
            local_end=num_computed_tokens,
            num_tokens=len(prompt),
            exact_end=probe.prefix_tokens,
        )
        end = self._loadable_end(probe.prefix_tokens, len(prompt))
        if blend:
            blend_end = blend_span_end(
                probe.segments, num_tokens=len(prompt), block_size=self._block_size, exact_end=end
            )
            gate = None
            if blend_end is not None and blend_end > num_computed_tokens:
                assert choice is not None
                makeup = span_makeup(probe.segments, num_computed_tokens, blend_end)
                gate = self._gate.decide(makeup, choice.ratio, blend_end - max(end, num_computed_tokens))
                if gate.blend:
                    if len(self._queued_blends) >= self._settings.blend_passes_per_step:
                        self._probes.pop(request.request_id, None)
                        self._accounts.pop(request.request_id, None)
                        return None, False  # this step's passes are taken: vLLM asks again in a later step
                    self._probes[request.request_id] = dataclasses.replace(
                        probe, blend_end=blend_end, choice=choice, makeup=makeup, gate=gate
                    )
                    # the span's cached tokens are served; past its last whole block only a block's tail remains
                    self._accounts[request.request_id] = dataclasses.replace(account, exact_end=len(prompt))
                    return blend_end - num_computed_tokens, False
            account.gate_refused = gate is not None and not gate.blend
            probe = dataclasses.replace(probe, gate=gate)
        probe = dataclasses.replace(probe, choice=choice)
        from_disk = probe.first_disk_token is not None and probe.first_disk_token < end
        load_async = self._async_disk_loads and from_disk and end > num_computed_tokens
        self._probes[request.request_id] = dataclasses.replace(probe, load_async=load_async)
        self._accounts[request.request_id] = account
        if end <= num_computed_tokens:
            return 0, False
        return end - num_computed_tokens, load_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        request_id = request.request_id
        probe = self._probes.pop(request_id, None)
        tracked = self._tracked.get(request_id)
        if tracked is None:
            tracked = self._tracked[request_id] = _Tracked(prompt=tuple(request.prompt_token_ids or ()))
        account = self._accounts.pop(request_id, None)
        if account is not None:  # vLLM took num_external_tokens right after its own hit
            account.served_end = account.local_end + max(0, num_external_tokens)
            tracked.account = account
        if probe is not None:
            tracked.store_prefix_tokens = probe.prefix_tokens
            tracked.choice = probe.choice
            tracked.gate = probe.gate
            tracked.makeup = probe.makeup
            tracked.planned_segments = probe.segments
        if num_external_tokens <= 0 or probe is None:
            if probe is not None:  # a (re)admission without a load: any older pin has no load left to serve
                self._release_pin(tracked)
            return
        if probe.blend_end is not None and probe.choice is not None:
            self._queue_blend(tracked, request_id, blocks, probe.blend_end, num_external_tokens, probe.choice)
            return
        end = self._loadable_end(probe.prefix_tokens, len(tracked.prompt))
        start = end - num_external_tokens
        assert start >= 0 and start % self._block_size == 0, f"vLLM asked to load from token {start}"
        block_ids = blocks.get_block_ids()[0]
        first, last = start // self._block_size, end // self._block_size
        self._release_pin(tracked)
        pinned = self._link.call(
            "pin", lambda client: (client.lookup(tracked.prompt, blend=False, repeat=True), client.client_token)
        )
        tracked.pinned, tracked.pin_owner = pinned if pinned is not None else (None, None)
        tracked.planned_load_tokens = end - start
        self._queued_loads[request_id] = LoadSpec(
            request_id=request_id,
            token_ids=tracked.prompt,
            block_ids=tuple(block_ids[first:last]),
            start=start,
            end=end,
            is_async=probe.load_async,
            plan=tracked.pinned,
            plan_owner=tracked.pin_owner,
            readers=self._readers,
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVStoreConnectorMetadata:
        metadata = KVStoreConnectorMetadata(
            loads=list(self._queued_loads.values()),
            blends=list(self._queued_blends.values()),
            step_tokens=scheduler_output.total_num_scheduled_tokens,
        )
        for request_id in self._queued_loads:  # the worker retrieves (or releases) the handed plan: not ours now
            handed = self._tracked.get(request_id)
            if handed is not None:
                handed.pinned = handed.pin_owner = None
        self._queued_loads.clear()
        self._queued_blends.clear()
        cached = scheduler_output.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", ()))  # vLLM 0.34 sends a resumed request as a new one
        readmitted = {request.req_id for request in scheduler_output.scheduled_new_reqs} | resumed
        for preempted in set(scheduler_output.preempted_req_ids or ()) - readmitted:
            self._forget_blocks(preempted)  # a request readmitted in this same step keeps its new load's pin
        for new_request in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new_request.req_id)
            if tracked is None:
                tracked = self._tracked[new_request.req_id] = _Tracked(prompt=tuple(new_request.prompt_token_ids or ()))
            tracked.block_ids = list(new_request.block_ids[0])
            done = new_request.num_computed_tokens + scheduler_output.num_scheduled_tokens[new_request.req_id]
            self._maybe_save(new_request.req_id, tracked, done, metadata)
        for index, request_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(request_id)
            if tracked is None:
                continue
            new_blocks = cached.new_block_ids[index]
            if request_id in resumed:
                tracked.block_ids = list(new_blocks[0]) if new_blocks is not None else []
            elif new_blocks is not None:
                tracked.block_ids.extend(new_blocks[0])
            done = cached.num_computed_tokens[index] + scheduler_output.num_scheduled_tokens[request_id]
            self._maybe_save(request_id, tracked, done, metadata)
        return metadata

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        finished = set(connector_output.finished_recving or ())
        worker_meta = connector_output.kv_connector_worker_meta
        loaded = worker_meta.finished_loads if isinstance(worker_meta, KVStoreWorkerMetadata) else {}
        blended = worker_meta.finished_blends if isinstance(worker_meta, KVStoreWorkerMetadata) else {}
        if isinstance(worker_meta, KVStoreWorkerMetadata):
            for step_ms, step_tokens in worker_meta.prefill_steps:
                self._gate.observe_prefill_step(step_ms, step_tokens)
        for request_id, outcome in blended.items():
            self._record_blend(request_id, outcome)
        for request_id in finished | loaded.keys():
            tracked = self._tracked.get(request_id)
            if tracked is None:
                continue
            self._release_pin(tracked)
            if request_id in loaded:
                num_loaded = min(loaded[request_id], tracked.planned_load_tokens)
                tracked.loaded_tokens += num_loaded
                tracked.load_failed_tokens += tracked.planned_load_tokens - num_loaded
                if tracked.account is not None and tracked.planned_load_tokens > num_loaded:
                    assert isinstance(worker_meta, KVStoreWorkerMetadata)  # ``loaded`` came from it
                    reasons = worker_meta.load_misses.get(request_id, {})
                    tracked.account.fail_delivery(tracked.planned_load_tokens - num_loaded, reasons)
                tracked.planned_load_tokens = 0

    def request_finished(self, request: Request) -> dict[str, object] | None:
        """Drop everything of a finished or aborted request (its blocks are vLLM's to free: saves copy out in the
        step that computes them, so nothing here ever holds a block); returns its ``kv_transfer_params``."""
        self._probes.pop(request.request_id, None)
        self._accounts.pop(request.request_id, None)
        self._queued_loads.pop(request.request_id, None)
        self._queued_blends.pop(request.request_id, None)
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is None:
            return None
        self._release_pin(tracked)
        if tracked.planned_blend is not None and request.status is not RequestStatus.FINISHED_ABORTED:
            params = tracked.transfer_params()
            self._answered[request.request_id] = params  # the worker's report fills it in this same update
            self._tracked[request.request_id] = tracked
            return params
        if tracked.planned_load_tokens and request.status is not RequestStatus.FINISHED_ABORTED:
            # Finished in the step of its (sync) load, whose report vLLM hands over after finishing requests: the
            # load filled every block, or vLLM, which reads failed blocks first, would have rescheduled the request.
            tracked.loaded_tokens += tracked.planned_load_tokens
            tracked.planned_load_tokens = 0
        return self._finished_params(tracked)

    def take_stats(self) -> KVStoreConnectorStats | None:
        """The finished requests' looked-up and missed tokens since the last call (``None``: none finished)."""
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KVStoreConnectorStats()
        return stats

    def _finished_params(self, tracked: _Tracked) -> dict[str, object]:
        """A finished request's ``kv_transfer_params``, its looked-up and missed tokens counted into the stats."""
        params = tracked.transfer_params()
        report = params["kvstore"]
        assert isinstance(report, dict)
        if "looked_up_tokens" in report:
            self._stats.record(looked_up_tokens=report["looked_up_tokens"])
            self._stats.record(**{f"{MISSED_PREFIX}{name}": count for name, count in report["miss_reasons"].items()})
        return params

    def hit_tiers(self, request_id: str, num_external_tokens: int) -> dict[TierName | None, int]:
        """The store tier that holds each of the ``num_external_tokens`` vLLM took for the request, as the probe behind
        its planned load or blend saw them (``None``: tokens no tier holds, which the blend pass computes). The
        external tokens are the last ones of the load or blend span; the counts sum to ``num_external_tokens``."""
        if num_external_tokens <= 0:
            return {}
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return {None: num_external_tokens}
        blend = tracked.planned_blend
        end = blend.end if blend is not None else self._loadable_end(tracked.store_prefix_tokens, len(tracked.prompt))
        if end < num_external_tokens:  # not a hit this side planned: vLLM counts it, nothing here says where from
            return {None: num_external_tokens}
        return tokens_by_tier(tracked.planned_segments, end - num_external_tokens, end)

    def close(self) -> None:
        """Release every pin and close the link (a goodbye; an embedded server this process started stops)."""
        for tracked in self._tracked.values():
            self._release_pin(tracked)
        self._tracked.clear()
        self._link.close()

    # -- helpers ------------------------------------------------------------------------------------------------

    def _queue_blend(
        self,
        tracked: _Tracked,
        request_id: str,
        blocks: KVCacheBlocks,
        end: int,
        num_external_tokens: int,
        choice: BlendChoice,
    ) -> None:
        start = end - num_external_tokens
        assert start >= 0 and start % self._block_size == 0, f"vLLM asked to blend from token {start}"
        block_ids = blocks.get_block_ids()[0]
        self._release_pin(tracked)
        spec = BlendSpec(
            request_id=request_id,
            token_ids=tracked.prompt,
            block_ids=tuple(block_ids[start // self._block_size : end // self._block_size]),
            local_end=start,
            end=end,
            ratio=choice.ratio,
            report_selection=choice.report_selection,
        )
        tracked.planned_blend = spec
        tracked.blended = True
        self._queued_blends[request_id] = spec

    def _record_blend(self, request_id: str, outcome: BlendOutcome | None) -> None:
        tracked = self._tracked.get(request_id)
        if tracked is None or tracked.planned_blend is None:
            return
        if outcome is not None and tracked.makeup is not None:
            self._gate.observe_pass(tracked.makeup, tracked.planned_blend.ratio, outcome.blend_ms)
        tracked.record_blend(tracked.planned_blend, outcome)
        answered = self._answered.pop(request_id, None)
        if answered is not None:  # finished in its blend step: complete the answer vLLM has not sent yet
            answered.update(self._finished_params(tracked))
            self._tracked.pop(request_id, None)

    def _probe_for_save(self, request_id: str, prompt: tuple[int, ...]) -> None:
        """A producer (``kv_producer``) loads nothing, but it looks the prompt up (unpinned) so that its save skips
        the chunks the store holds already: a prefill engine sees the same documents again and again, and would
        otherwise send every one of them back in every prefill. No miss account: it looked up nothing to load."""
        if not self._save:
            return
        probe = self._link.call("lookup", lambda client: _probe(client, prompt))
        if probe is None:
            self._probes.pop(request_id, None)
        else:
            self._probes[request_id] = probe

    def _loadable_end(self, prefix_tokens: int, prompt_tokens: int) -> int:
        """The store's hit cut to a block boundary, leaving at least one prompt token for vLLM to compute."""
        end = min(prefix_tokens, prompt_tokens - 1)
        return end - end % self._block_size

    def _forget_blocks(self, request_id: str) -> None:
        """A preempted request lost its blocks: its queued load is void and its pins go (it is looked up again
        when it is rescheduled)."""
        self._queued_loads.pop(request_id, None)
        self._queued_blends.pop(request_id, None)
        tracked = self._tracked.get(request_id)
        if tracked is not None:
            tracked.planned_blend = None  # a late report of its pass is dropped: its blocks are gone
            tracked.block_ids = []
            tracked.planned_load_tokens = 0  # a late report of its load counts what arrived, fails nothing
            self._release_pin(tracked)

    def _maybe_save(
        self, request_id: str, tracked: _Tracked, num_done: int, metadata: KVStoreConnectorMetadata
    ) -> None:
        """Queue the store of a prompt whose prefill completes in this step, from the first chunk the store lacks."""
        prompt_tokens = len(tracked.prompt)
        if not self._save or tracked.saved or num_done < prompt_tokens or not prompt_tokens:
            return
        if tracked.blended:  # its KV is approximate, and its documents are stored already
            tracked.saved = True
            return
        tracked.saved = True
        # From the block holding the end of the store's prefix hit: the store writes the chunks that begin at or
        # after it (its cut need not fall on blocks: a separator restarts chunks anywhere).
        start = tracked.store_prefix_tokens - tracked.store_prefix_tokens % self._block_size
        if start >= prompt_tokens:
            return
        first = start // self._block_size
        last = -(-prompt_tokens // self._block_size)
        if last > len(tracked.block_ids):
            logger.warning(
                "request %s: %d blocks for a %d-token prompt; not stored",
                request_id,
                len(tracked.block_ids),
                prompt_tokens,
            )
            return
        metadata.saves.append(
            SaveSpec(
                request_id=request_id,
                token_ids=tracked.prompt,
                block_ids=tuple(tracked.block_ids[first:last]),
                start=start,
                end=prompt_tokens,
            )
        )

    def _release_pin(self, tracked: _Tracked) -> None:
        """Release a pin this side still holds (a load that never reached a worker), under the token it was taken
        with: a link that reconnected since has a new one, and the server dropped the old client's plans anyway."""
        plan, owner = tracked.pinned, tracked.pin_owner
        tracked.pinned = tracked.pin_owner = None
        if plan is not None:
            self._link.call("release", lambda client: client.release(plan, owner=owner))


def _probe(client: Client, prompt: tuple[int, ...], *, blend: bool = False) -> _Probe:
    """An unpinned look at the prompt in the store (one round trip: the server drops the pins before answering):
    its exact prefix, and with ``blend`` its cached chunks anywhere (by content)."""
    plan = client.lookup(prompt, blend=blend, pin=False)
    prefix_tokens = plan.num_prefix_tokens
    first_disk = next(
        (segment.start for segment in plan.segments if segment.exact and segment.tier is TierName.DISK), None
    )
    return _Probe(prefix_tokens=prefix_tokens, first_disk_token=first_disk, segments=plan.segments, misses=plan.misses)
