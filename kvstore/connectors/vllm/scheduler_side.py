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

Each request's state is one ``RequestRecord`` (``request_record``), its phase explicit; the side keeps one dict of
them, and a finished request drops its entry.

Single-threaded, as vLLM's scheduler is.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from vllm.v1.request import RequestStatus

from kvstore.blend.vllm.gate import BlendGate, GateDecision, span_makeup
from kvstore.blend.vllm.hook import BlendOutcome
from kvstore.blend.vllm.request_choice import BlendChoice, blend_choice
from kvstore.blend.vllm.span import blend_span_end
from kvstore.chunking import Chunking
from kvstore.client import Client
from kvstore.connectors.settings import ConnectorSettings
from kvstore.connectors.store_link import StoreLink
from kvstore.connectors.vllm.hit_sources import tokens_by_tier
from kvstore.connectors.vllm.kv_groups import NULL_BLOCK_ID, KVGroup, KVGroups
from kvstore.connectors.vllm.metadata import (
    MISSED_PREFIX,
    UNSAVED_PREFIX,
    BlendSpec,
    KVStoreConnectorMetadata,
    KVStoreConnectorStats,
    KVStoreWorkerMetadata,
    LoadSpec,
    SaveSpec,
)
from kvstore.connectors.vllm.request_misses import MissAccount, declined_account
from kvstore.connectors.vllm.request_record import HeldPin, Probe, RequestPhase, RequestRecord
from kvstore.keys import as_token_array, chunk_bounds
from kvstore.tiers.base import TierName

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["SchedulerSide"]

logger = logging.getLogger(__name__)


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
        groups: the engine's KV cache groups (``None``: one full-attention group); block ids travel per group.
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
        groups: KVGroups | None = None,
    ) -> None:
        self._link = link
        self._groups = groups or KVGroups(groups=(KVGroup(layer_names=()),), block_size=block_size)
        self._cut: tuple[int, tuple[int, ...], Chunking] | None = None  # the store's (its hello), at a step's save
        self._settings = settings or ConnectorSettings()
        self._gate = BlendGate(num_layers=num_layers, check_layer=self._settings.blend_check_layer)
        self._readers = readers
        self._block_size = block_size
        self._load = load
        self._save = save
        self._async_disk_loads = async_disk_loads
        # request id -> its record; a record queued in this step is moved last, so the step's loads and passes go
        # to the workers in the order vLLM admitted them
        self._requests: dict[str, RequestRecord] = {}
        self._stats = KVStoreConnectorStats()  # finished requests' looked-up and missed tokens

    # -- vLLM's scheduler hooks ---------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        prompt = tuple(request.prompt_token_ids or ())
        if len(prompt) <= self._block_size:
            return 0, False
        if not self._load:
            self._probe_for_save(request.request_id, prompt)
            return 0, False
        record = self._requests.get(request.request_id)
        if record is not None and record.load_failed_tokens:
            record.offered = declined_account(len(prompt), num_computed_tokens, record.account)
            return 0, False  # its load fell short once: vLLM recomputes rather than retry a store that failed it
        choice = blend_choice(self._settings, request.kv_transfer_params) if self._settings.blend else None
        blend = choice is not None and choice.enabled
        probe = self._link.call("lookup", lambda client: _probe(client, prompt, blend=blend))
        record = self._record(request.request_id, prompt)
        if probe is None:
            record.probe, record.offered = None, declined_account(len(prompt), num_computed_tokens)
            return 0, False
        account = MissAccount(
            segments=probe.segments,
            misses=probe.misses,
            local_end=num_computed_tokens,
            num_tokens=len(prompt),
            exact_end=probe.prefix_tokens,
        )
        end = self._loadable_end(probe.prefix_tokens, len(prompt))
        if blend:
            assert choice is not None
            blend_end = blend_span_end(
                probe.segments, num_tokens=len(prompt), block_size=self._block_size, exact_end=end
            )
            if blend_end is not None and blend_end > num_computed_tokens:
                makeup = span_makeup(probe.segments, num_computed_tokens, blend_end)
                gate = (
                    self._gate.decide(makeup, choice.ratio, blend_end - max(end, num_computed_tokens))
                    if self._settings.blend_gate
                    else GateDecision(blend=True, pass_ms=None, prefill_ms=None)
                )
                if gate.blend:
                    span = dataclasses.replace(probe, blend_end=blend_end, choice=choice, makeup=makeup, gate=gate)
                    return self._offer_blend(record, span, account, num_computed_tokens)
                account.gate_refused = True
                probe = dataclasses.replace(probe, gate=gate)
        probe = dataclasses.replace(probe, choice=choice)
        from_disk = probe.first_disk_token is not None and probe.first_disk_token < end
        # a hybrid engine can only fail a load whole, which vLLM takes for an async load alone (failed_recving)
        load_async = (self._groups.hybrid or (self._async_disk_loads and from_disk)) and end > num_computed_tokens
        record.probe, record.offered = dataclasses.replace(probe, load_async=load_async), account
        if end <= num_computed_tokens:
            return 0, False
        return end - num_computed_tokens, load_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        record = self._record(request.request_id, tuple(request.prompt_token_ids or ()))
        record.admit()
        probe, record.probe = record.probe, None
        account, record.offered = record.offered, None
        if account is not None:  # vLLM took num_external_tokens right after its own hit
            account.served_end = account.local_end + max(0, num_external_tokens)
            record.account = account
        if probe is not None:
            record.admitted = probe
        if num_external_tokens <= 0 or probe is None:
            if probe is not None:  # a (re)admission without a load: any older pin has no load left to serve
                self._release_pin(record)
            return
        self._release_pin(record)
        if probe.blend_end is not None and probe.choice is not None:
            self._queue_blend(request.request_id, record, blocks, probe.blend_end, num_external_tokens, probe.choice)
        else:
            self._queue_load(request.request_id, record, blocks, probe, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVStoreConnectorMetadata:
        metadata = KVStoreConnectorMetadata(step_tokens=scheduler_output.total_num_scheduled_tokens)
        for record in self._requests.values():  # the worker retrieves (or releases) a handed plan: not ours now
            if record.phase is RequestPhase.LOAD_QUEUED:
                assert isinstance(record.transfer, LoadSpec), "a queued load's record holds its LoadSpec"
                metadata.loads.append(record.transfer)
            elif record.phase is RequestPhase.BLEND_QUEUED:
                assert isinstance(record.transfer, BlendSpec), "a queued pass's record holds its BlendSpec"
                metadata.blends.append(record.transfer)
            else:
                continue
            record.hand_over()
        cached = scheduler_output.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", ()))  # vLLM 0.34 sends a resumed request as a new one
        readmitted = {request.req_id for request in scheduler_output.scheduled_new_reqs} | resumed
        for preempted in set(scheduler_output.preempted_req_ids or ()) - readmitted:
            self._forget_blocks(preempted)  # a request readmitted in this same step keeps its new load's pin
        for new_request in scheduler_output.scheduled_new_reqs:
            record = self._record(new_request.req_id, tuple(new_request.prompt_token_ids or ()))
            record.admit()
            record.block_ids = [list(ids) for ids in new_request.block_ids]
            computed = new_request.num_computed_tokens
            done = computed + scheduler_output.num_scheduled_tokens[new_request.req_id]
            self._maybe_save(new_request.req_id, record, computed, done, metadata)
        for index, request_id in enumerate(cached.req_ids):
            found = self._requests.get(request_id)
            if found is None or found.phase is RequestPhase.PROBED:
                continue
            new_blocks = cached.new_block_ids[index]
            if request_id in resumed:
                found.block_ids = [list(ids) for ids in new_blocks] if new_blocks is not None else []
            elif new_blocks is not None:
                if not found.block_ids:
                    found.block_ids = [[] for _ in new_blocks]
                for held, added in zip(found.block_ids, new_blocks, strict=True):
                    held.extend(added)
            computed = cached.num_computed_tokens[index]
            done = computed + scheduler_output.num_scheduled_tokens[request_id]
            self._maybe_save(request_id, found, computed, done, metadata)
        return metadata

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        finished = set(connector_output.finished_recving or ())
        worker_meta = connector_output.kv_connector_worker_meta
        if not isinstance(worker_meta, KVStoreWorkerMetadata):
            worker_meta = KVStoreWorkerMetadata()
        for step_ms, step_tokens in worker_meta.prefill_steps:
            self._gate.observe_prefill_step(step_ms, step_tokens)
        for request_id, outcome in worker_meta.finished_blends.items():
            self._record_blend(request_id, outcome)
        loaded = worker_meta.finished_loads
        for request_id in finished | loaded.keys():
            record = self._requests.get(request_id)
            if record is None or record.phase is RequestPhase.PROBED:
                continue
            self._release_pin(record)
            if request_id in loaded:
                record.finish_load(loaded[request_id], worker_meta.load_misses.get(request_id, {}))

    def request_finished(self, request: Request) -> dict[str, object] | None:
        """Drop a finished or aborted request's record (its blocks are vLLM's to free: saves copy out in the step
        that computes them, so nothing here ever holds a block); returns its ``kv_transfer_params``."""
        record = self._requests.pop(request.request_id, None)
        if record is None or record.phase is RequestPhase.PROBED:
            return None
        self._release_pin(record)
        aborted = request.status is RequestStatus.FINISHED_ABORTED
        if record.planned_blend is not None and not aborted:
            params = record.transfer_params()
            record.finish_awaiting_blend(params)  # the worker's report fills it in this same update
            self._requests[request.request_id] = record
            return params
        if record.planned_load_tokens and not aborted:
            # Finished in the step of its (sync) load, whose report vLLM hands over after finishing requests: the
            # load filled every block, or vLLM, which reads failed blocks first, would have rescheduled the request.
            record.finish_load(record.planned_load_tokens, {})
        return self._finished_params(record)

    def take_stats(self) -> KVStoreConnectorStats | None:
        """The finished requests' looked-up and missed tokens since the last call (``None``: none finished)."""
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KVStoreConnectorStats()
        return stats

    def hit_tiers(self, request_id: str, num_external_tokens: int) -> dict[TierName | None, int]:
        """The store tier that holds each of the ``num_external_tokens`` vLLM took for the request, as the probe behind
        its planned load or blend saw them (``None``: tokens no tier holds, which the blend pass computes). The
        external tokens are the last ones of the load or blend span; the counts sum to ``num_external_tokens``."""
        if num_external_tokens <= 0:
            return {}
        record = self._requests.get(request_id)
        if record is None or record.phase is RequestPhase.PROBED:
            return {None: num_external_tokens}
        blend = record.planned_blend
        end = blend.end if blend is not None else self._loadable_end(record.store_prefix_tokens, len(record.prompt))
        if end < num_external_tokens:  # not a hit this side planned: vLLM counts it, nothing here says where from
            return {None: num_external_tokens}
        segments = record.admitted.segments if record.admitted is not None else ()
        return tokens_by_tier(segments, end - num_external_tokens, end)

    def close(self) -> None:
        """Release every pin and close the link (a goodbye; an embedded server this process started stops)."""
        for record in self._requests.values():
            self._release_pin(record)
        self._requests.clear()
        self._link.close()

    # -- helpers ------------------------------------------------------------------------------------------------

    def _record(self, request_id: str, prompt: tuple[int, ...]) -> RequestRecord:
        """The request's record, a new one (``PROBED``) when it has none."""
        record = self._requests.get(request_id)
        if record is None:
            record = self._requests[request_id] = RequestRecord(prompt=prompt)
        return record

    def _offer_blend(
        self, record: RequestRecord, probe: Probe, account: MissAccount, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Offer the span up to ``probe.blend_end`` for a pass, or ``None`` ("ask again") when this step's passes
        are taken."""
        queued = sum(other.phase is RequestPhase.BLEND_QUEUED for other in self._requests.values())
        if queued >= self._settings.blend_passes_per_step:
            record.probe = record.offered = None
            return None, False  # vLLM asks again in a later step
        assert probe.blend_end is not None, "a blend offer's probe carries its span's end"
        record.probe = probe
        # the span's cached tokens are served; past its last whole block only a block's tail remains
        record.offered = dataclasses.replace(account, exact_end=len(record.prompt))
        return probe.blend_end - num_computed_tokens, False

    def _queue_load(
        self, request_id: str, record: RequestRecord, blocks: KVCacheBlocks, probe: Probe, num_external_tokens: int
    ) -> None:
        end = self._loadable_end(probe.prefix_tokens, len(record.prompt))
        start = end - num_external_tokens
        assert start >= 0 and start % self._block_size == 0, f"vLLM asked to load from token {start}"
        group_block_ids = blocks.get_block_ids()  # a sliding-window group's are null outside the window
        first, last = start // self._block_size, end // self._block_size
        prompt = record.prompt
        pin = self._link.call("pin", lambda client: _pin(client, prompt))
        spec = LoadSpec(
            request_id=request_id,
            token_ids=prompt,
            block_ids=tuple(group_block_ids[0][first:last]),
            other_groups=tuple(tuple(ids[first:last]) for ids in group_block_ids[1:]),
            start=start,
            end=end,
            is_async=probe.load_async,
            plan=pin.plan if pin is not None else None,
            plan_owner=pin.owner if pin is not None else None,
            readers=self._readers,
        )
        record.queue_load(spec, pin)
        self._requests[request_id] = self._requests.pop(request_id)  # last: this step's queue keeps vLLM's order

    def _queue_blend(
        self,
        request_id: str,
        record: RequestRecord,
        blocks: KVCacheBlocks,
        end: int,
        num_external_tokens: int,
        choice: BlendChoice,
    ) -> None:
        start = end - num_external_tokens
        assert start >= 0 and start % self._block_size == 0, f"vLLM asked to blend from token {start}"
        block_ids = blocks.get_block_ids()[0]
        spec = BlendSpec(
            request_id=request_id,
            token_ids=record.prompt,
            block_ids=tuple(block_ids[start // self._block_size : end // self._block_size]),
            local_end=start,
            end=end,
            ratio=choice.ratio,
            report_selection=choice.report_selection,
        )
        record.queue_blend(spec)
        self._requests[request_id] = self._requests.pop(request_id)  # last: this step's queue keeps vLLM's order

    def _record_blend(self, request_id: str, outcome: BlendOutcome | None) -> None:
        record = self._requests.get(request_id)
        spec = record.planned_blend if record is not None else None
        if record is None or spec is None:
            return
        makeup = record.admitted.makeup if record.admitted is not None else None
        if outcome is not None and makeup is not None:
            self._gate.observe_pass(makeup, spec.ratio, outcome.blend_ms)
        record.finish_blend(spec, outcome)
        if record.answer is not None:  # finished in its blend step: complete the answer vLLM has not sent yet
            record.answer.update(self._finished_params(record))
            del self._requests[request_id]

    def _finished_params(self, record: RequestRecord) -> dict[str, object]:
        """A finished request's ``kv_transfer_params``, its looked-up and missed tokens counted into the stats."""
        params = record.transfer_params()
        report = params["kvstore"]
        assert isinstance(report, dict)
        if "looked_up_tokens" in report:
            self._stats.record(looked_up_tokens=report["looked_up_tokens"])
            self._stats.record(**{f"{MISSED_PREFIX}{name}": count for name, count in report["miss_reasons"].items()})
        return params

    def _probe_for_save(self, request_id: str, prompt: tuple[int, ...]) -> None:
        """A producer (``kv_producer``) loads nothing, but it looks the prompt up (unpinned) so that its save skips
        the chunks the store holds already: a prefill engine sees the same documents again and again, and would
        otherwise send every one of them back in every prefill. No miss account: it looked up nothing to load."""
        if not self._save:
            return
        probe = self._link.call("lookup", lambda client: _probe(client, prompt))
        if probe is not None:
            self._record(request_id, prompt).probe = probe
        elif request_id in self._requests:
            self._requests[request_id].probe = None

    def _loadable_end(self, prefix_tokens: int, prompt_tokens: int) -> int:
        """The store's hit cut to a block boundary, leaving at least one prompt token for vLLM to compute."""
        end = min(prefix_tokens, prompt_tokens - 1)
        return end - end % self._block_size

    def _forget_blocks(self, request_id: str) -> None:
        """A preempted request lost its blocks: its queued load or pass is void and its pins go (it is looked up
        again when it is rescheduled)."""
        record = self._requests.get(request_id)
        if record is not None and record.phase is not RequestPhase.PROBED:
            self._release_pin(record)
            record.lose_blocks()

    def _maybe_save(
        self,
        request_id: str,
        record: RequestRecord,
        num_computed: int,
        num_done: int,
        metadata: KVStoreConnectorMetadata,
    ) -> None:
        """Queue the store of a prompt's KV in the step that completes its prefill, from the first chunk the store
        lacks. With a sliding-window group, a prefill over several steps also saves in the last step before vLLM
        would free a block the save still needs (from the start of the next step, ``KVGroups.held_start``): every
        save reads only blocks vLLM holds in its step, and a chunk whose blocks went before it was complete (a
        window shorter than a chunk, or vLLM's own prefix hit) ends the prompt's saves there, counted as
        ``unsaved_sliding_window`` tokens."""
        prompt_tokens = len(record.prompt)
        if not self._save or record.saved or not prompt_tokens:
            return
        end = min(num_done, prompt_tokens)
        complete = end == prompt_tokens
        if not complete and not self._groups.frees_blocks:
            return
        if record.blended:  # its KV is approximate, and its documents are stored already
            record.saved = complete
            return
        start = self._save_start(record)
        if self._groups.held_start(num_computed) > start:
            self._cut_save(request_id, record, start)
            return
        if not complete and self._groups.held_start(end) <= start:
            return  # the next step still holds every block from start on: one longer save later
        record.saved = complete
        if start >= end:
            return
        first = start // self._block_size
        last = -(-end // self._block_size)
        if not record.block_ids or any(last > len(ids) for ids in record.block_ids):
            logger.warning(
                "request %s: %s blocks for %d tokens; not stored",
                request_id,
                [len(ids) for ids in record.block_ids],
                end,
            )
            record.saved = True
            return
        group_block_ids = [tuple(ids[first:last]) for ids in record.block_ids]
        if any(NULL_BLOCK_ID in ids for ids in group_block_ids):  # vLLM holds none there: never read a stale id
            self._cut_save(request_id, record, start)
            return
        metadata.saves.append(
            SaveSpec(
                request_id=request_id,
                token_ids=record.prompt[:end],
                block_ids=group_block_ids[0],
                start=start,
                end=end,
                other_groups=tuple(group_block_ids[1:]),
            )
        )
        record.saved_end = end

    def _save_start(self, record: RequestRecord) -> int:
        """Where the prompt's next save starts: the block holding the end of the store's hit (the store writes the
        chunks that begin at or after it; its cut need not fall on blocks; a hit ending in a slice of a stored chunk
        counts from the slice's start, where the prompt's own chunk begins), or, after an earlier step's save, the
        block holding the start of the prompt's chunk that save ended in (partial there, it is stored whole now).
        The store's cut (size, separator, rule) comes from its hello; not knowing it, the whole earlier save
        again."""
        store_start = record.store_held_tokens - record.store_held_tokens % self._block_size
        if record.saved_end is None:
            return store_start
        if self._cut is None:
            self._cut = self._link.call("hello", _store_cut)
        if self._cut is None:
            return store_start
        chunk_size, separator, chunking = self._cut
        bounds = chunk_bounds(as_token_array(record.prompt), chunk_size, separator, chunking)
        resend_from = max(bound for bound in bounds if bound <= record.saved_end)  # the prompt's own cut
        return max(store_start, resend_from - resend_from % self._block_size)

    def _cut_save(self, request_id: str, record: RequestRecord, start: int) -> None:
        """End a prompt's saves at ``start``: vLLM freed a sliding-window block the next chunk needs."""
        record.saved = True
        unsaved = len(record.prompt) - start
        logger.debug("request %s: tokens [%d, %d) not stored: a sliding window freed their blocks", request_id,
                     start, len(record.prompt))  # fmt: skip
        self._stats.record(**{f"{UNSAVED_PREFIX}sliding_window": unsaved})

    def _release_pin(self, record: RequestRecord) -> None:
        """Release a pin this side still holds (a load that never reached a worker), under the token it was taken
        with: a link that reconnected since has a new one, and the server dropped the old client's plans anyway."""
        pin, record.pin = record.pin, None
        if pin is not None:
            self._link.call("release", lambda client: client.release(pin.plan, owner=pin.owner))


def _probe(client: Client, prompt: tuple[int, ...], *, blend: bool = False) -> Probe:
    """An unpinned look at the prompt in the store (one round trip: the server drops the pins before answering):
    its exact prefix, and with ``blend`` its cached chunks anywhere (by content)."""
    plan = client.lookup(prompt, blend=blend, pin=False)
    prefix_tokens = plan.num_prefix_tokens
    first_disk = next(
        (segment.start for segment in plan.segments if segment.exact and segment.tier is TierName.DISK), None
    )
    return Probe(prefix_tokens=prefix_tokens, first_disk_token=first_disk, segments=plan.segments, misses=plan.misses)


def _store_cut(client: Client) -> tuple[int, tuple[int, ...], Chunking]:
    """How the store cuts a prompt into chunks (its hello): chunk size, separator, rule."""
    server = client.server
    return server.chunk_size, tuple(server.chunk_separator), server.chunking


def _pin(client: Client, prompt: tuple[int, ...]) -> HeldPin:
    """The prompt's plan, pinned for the workers' load, under this side's client token."""
    return HeldPin(plan=client.lookup(prompt, blend=False, repeat=True), owner=client.client_token)
