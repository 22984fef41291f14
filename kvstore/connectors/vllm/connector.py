"""``KVStoreConnector``: kvstore as vLLM's KV connector (v1 API; vLLM 0.32, 0.33 and 0.34).

Loaded the way vLLM loads any out-of-tree connector::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.connectors.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"kvstore.url": "tcp://127.0.0.1:5555"}}'

vLLM builds one instance per role: ``SCHEDULER`` in the EngineCore process (``SchedulerSide``) and ``WORKER`` in
each worker process (``WorkerSide``); this class only checks the engine, links each half to the store and forwards
vLLM's calls. Without ``kvstore.url`` the first instance starts a private ``kvstore serve`` on
``kvstore.data_dir`` (``embedded_server``) and the other finds it there.

``kv_role``: ``kv_both`` loads and stores, ``kv_consumer`` only loads, ``kv_producer`` only stores, and answers a
request only once its prompt is in the store (a prefill/decode split: docs/vllm.md).

Besides the hooks every connector implements, vLLM (0.32 to 0.34) reads:

- ``get_transfer_results`` (its worker reads this, not ``get_finished``): the async loads that finished, and as
  ``failed_recving`` those that put nothing in place. A load that fell short part-way is not one of them: its missing
  blocks go to ``get_block_ids_with_load_errors``, so vLLM keeps what it loaded (``failed_recving`` would drop it all).
- ``get_external_cache_hit_sources``: a hit's tokens by the kvstore tier that holds them (``gpu`` device, ``cpu``
  host, ``disk`` disk; ``remote``, and the gaps a blend pass computes, ``external_unspecified``), which vLLM counts
  in ``vllm:prompt_tokens_cached_by_source``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvstore.connectors.hook_clock import HookClock
from kvstore.connectors.settings import ConnectorSettings, parse_connector_settings, settle_data_dir
from kvstore.connectors.store_link import StoreLink, connect_links
from kvstore.connectors.vllm.cache_shapes import check_blend_supported
from kvstore.connectors.vllm.engine_facts import check_engine_supported, engine_layout, resolve_chunk_separator
from kvstore.connectors.vllm.kv_groups import KVGroups, check_groups_compose, kv_groups_of
from kvstore.connectors.vllm.metadata import KVStoreConnectorMetadata, KVStoreConnectorStats
from kvstore.connectors.vllm.parallel import check_parallel_blend
from kvstore.connectors.vllm.scheduler_side import SchedulerSide
from kvstore.connectors.vllm.worker_side import WorkerSide
from kvstore.errors import KVStoreError
from kvstore.layout import KVLayout
from kvstore.tiers.base import TierName

if TYPE_CHECKING:
    import torch
    from vllm.attention.backends.abstract import AttentionMetadata
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["SOURCE_OF_TIER", "KVStoreConnector", "cache_hit_sources"]

logger = logging.getLogger(__name__)

SOURCE_OF_TIER: Mapping[TierName | None, CacheHitSource] = MappingProxyType(
    {
        TierName.GPU: CacheHitSource.DEVICE,
        TierName.CPU: CacheHitSource.HOST,
        TierName.DISK: CacheHitSource.DISK,
        TierName.REMOTE: CacheHitSource.EXTERNAL_UNSPECIFIED,  # vLLM has no source for a store on another host
        None: CacheHitSource.EXTERNAL_UNSPECIFIED,  # a blend pass's gaps: computed, held by no tier
    }
)
"""vLLM's cache-hit source for the tokens a kvstore tier holds (``SchedulerSide.hit_tiers``)."""


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """kvstore behind vLLM's KV connector API.

    ``SupportsHMA``: vLLM keeps its hybrid KV cache manager on for a model with sliding-window layers (their memory
    saving), and hands the connector one KV cache group per attention type (``kv_groups``). Block ids travel per
    group; each layer is copied through its own group's blocks; the stored chunks stay whole, so an engine with the
    hybrid manager and one without (``--disable-hybrid-kv-cache-manager``) share them, at any tensor and pipeline
    parallel shape. Only full-attention and sliding-window groups are served, and without blending; anything else is
    refused at start with one line.

    Hooks left at vLLM's default, on purpose:

    - ``may_load_async`` (vLLM 0.34): vLLM asks it as a request enters its waiting queues, before any lookup; with
      ``--max-num-inflight-kv-loads``, ``True`` puts the request in a queue whose loads may start while the running
      batch is full. Whether kvstore loads a hit asynchronously depends on where the prompt's chunks are (on disk),
      which only a store round trip tells, so the honest cheap answer is the default (``False``, unless the request
      asks for a P/D remote prefill). ``True`` for every request would make each miss and memory hit a false
      positive, which vLLM keeps at the head of that queue while the batch is full, looking it up again (a round
      trip) every step and holding back the real async loads behind it. With the default a disk hit still loads
      asynchronously once admitted, and still counts against ``--max-num-inflight-kv-loads``.
    - ``handle_preemptions``: for connectors whose saves read a request's blocks after the step that computed them,
      which a preemption frees for another request. kvstore's saves copy the KV out of the blocks within that step
      (``save_kv_layer``, on the compute stream on CUDA, ahead of any later step's writes) and send the copy
      afterwards; async loads write only into the blocks of requests waiting for them, which vLLM never preempts
      (it preempts running requests) and whose blocks it keeps, even when aborted, until the load reports finished.
      The scheduler side drops a preempted request's queued load and pins itself (``build_connector_meta``).

    Raises (at construction, as one line):
        ConfigError: a bad ``kvstore.*`` setting, an unsupported vLLM, parallelism or KV cache, or an embedded
            server that refused its settings.
        LayoutMismatchError: the store holds another model's layout.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_through_vllm()
        transfer = self._kv_transfer_config
        try:
            settings = parse_connector_settings(transfer.kv_connector_extra_config)
            check_engine_supported(vllm_config, kv_cache_config)
            groups = _kv_groups(vllm_config, kv_cache_config)
            check_groups_compose(groups, blend=settings.blend)
            check_parallel_blend(vllm_config, settings)
            settings = resolve_chunk_separator(vllm_config, settings)
            layout = engine_layout(vllm_config, settings)
            check_blend_supported(layout, settings.blend)  # fp8 and MLA: exact prefix reuse only
            settings = settle_data_dir(settings, layout)
        except KVStoreError as exc:
            raise ValueError(f"KVStoreConnector: {exc}") from None
        block_size = vllm_config.cache_config.block_size
        name = f"vllm {transfer.engine_id} {role.name.lower()}"
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._clock = HookClock(role.name.lower())
        if role is KVConnectorRole.SCHEDULER:
            (link,) = _connected_links(settings, layout, (name,), settings.lookup_timeout_s)
            _require_chunk_cut(link, settings)
            self._scheduler = SchedulerSide(
                link,
                block_size=block_size,
                load=transfer.is_kv_consumer,
                save=transfer.is_kv_producer,
                async_disk_loads=settings.async_disk_loads,
                settings=settings,
                num_layers=layout.num_layers,
                readers=vllm_config.parallel_config.tensor_parallel_size
                * vllm_config.parallel_config.pipeline_parallel_size,
                groups=groups,
            )
            if settings.blend:
                _require_blend_server(link)
        else:
            kinds = ("load", "async-load", "save", "blend") if settings.blend else ("load", "async-load", "save")
            # each connected now (a link's first call must not be the one that finds the server), all at once
            load, async_load, save, *blend = _connected_links(
                settings, layout, [f"{name} {kind}" for kind in kinds], settings.transfer_timeout_s
            )
            blend_link = blend[0] if blend else None
            if blend_link is not None:
                _require_blend_server(blend_link)
            self._worker = WorkerSide(
                vllm_config,
                layout,
                (load, async_load, save),
                block_size=block_size,
                blend_link=blend_link,
                settings=settings,
                wait_for_saves=transfer.is_kv_producer and not transfer.is_kv_consumer,
                groups=groups,
            )
        logger.info(
            "KVStoreConnector (%s): layout %s, store %s",
            role.name.lower(),
            layout.describe(),
            settings.url or settings.embedded.data_dir,
        )

    # -- worker side ------------------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        try:
            self._worker_side().register_kv_caches(kv_caches)
        except KVStoreError as exc:
            raise ValueError(f"KVStoreConnector: {exc}") from None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, KVStoreConnectorMetadata), type(connector_metadata).__name__
        with self._clock:  # it may wait for the last step's gathers (PromptSaves.new_step)
            self._worker_side().bind(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        with self._clock:
            self._worker_side().start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        with self._clock:
            self._worker_side().wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        with self._clock:
            self._worker_side().save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        """The step's last hook: its time in hooks goes into the stats (and the trace)."""
        worker = self._worker_side()
        with self._clock:
            worker.wait_for_save()
        worker.record_on_path(self._clock.end_step())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished async loads, the failed ones among them (``FinishedLoads``); kvstore sends nothing."""
        done = self._worker_side().get_finished()
        return KVConnectorTransferResults(finished_recving=set(done.finished), failed_recving=set(done.failed))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The older form of ``get_transfer_results`` (no failures), for a caller that still reads it."""
        return None, set(self._worker_side().get_finished().finished) or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side().take_failed_blocks()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker_side().take_worker_metadata()

    @property
    def requires_kv_delivery(self) -> bool:
        """``False``: kvstore is a best-effort cache, so a preempted request whose save is still in flight may finish
        rather than be recomputed (vLLM's default for a ``kv_both`` connector is ``True``). A save copies the KV out
        of the blocks before the next step's forward can write them, and a save that never lands is a future miss, no
        more."""
        return False

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is not None:
            return self._worker.take_stats()
        return self._scheduler_side().take_stats()  # finished requests' looked-up and missed tokens

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVStoreConnectorStats(data=dict(data)) if data is not None else KVStoreConnectorStats()

    # -- scheduler side ---------------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        with self._clock:
            return self._scheduler_side().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        with self._clock:
            self._scheduler_side().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The scheduler's last hook of a step: its time in hooks is traced."""
        with self._clock:
            metadata = self._scheduler_side().build_connector_meta(scheduler_output)
        self._clock.end_step()
        return metadata

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        with self._clock:
            self._scheduler_side().update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        with self._clock:
            return False, self._scheduler_side().request_finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` under the hybrid manager: kvstore holds no block past the step that copies it, in
        any group, so vLLM frees them all at once."""
        return self.request_finished(request, [])

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        with self._clock:
            return cache_hit_sources(self._scheduler_side().hit_tiers(request.request_id, num_external_tokens))

    # -- both ---------------------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        if self._worker is not None:
            self._worker.close()

    def _worker_side(self) -> WorkerSide:
        assert self._worker is not None, "a worker-side call reached the scheduler's connector"
        return self._worker

    def _scheduler_side(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler-side call reached a worker's connector"
        return self._scheduler


def cache_hit_sources(tokens_by_tier: Mapping[TierName | None, int]) -> dict[CacheHitSource, int]:
    """Tokens per kvstore tier as tokens per vLLM cache-hit source (``SOURCE_OF_TIER``), non-zero counts only."""
    sources: dict[CacheHitSource, int] = {}
    for tier, num_tokens in tokens_by_tier.items():
        source = SOURCE_OF_TIER[tier]
        sources[source] = sources.get(source, 0) + num_tokens
    return {source: num_tokens for source, num_tokens in sources.items() if num_tokens}


def _kv_groups(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> KVGroups | None:
    """The engine's KV cache groups (``None``: vLLM gave the connector no cache config)."""
    if kv_cache_config is None:
        return None
    return kv_groups_of(kv_cache_config, vllm_config.cache_config.block_size)


def _log_through_vllm() -> None:
    """Send kvstore's log records to vLLM's handlers at vLLM's level (``VLLM_LOGGING_LEVEL``), so the connector's
    lines appear in the engine's log with its format instead of only warnings on bare stderr."""
    kvstore_logger = logging.getLogger("kvstore")
    vllm_logger = logging.getLogger("vllm")
    if kvstore_logger.handlers or not vllm_logger.handlers:
        return  # the application set up kvstore's logging itself, or vLLM set up none
    for handler in vllm_logger.handlers:
        kvstore_logger.addHandler(handler)
    kvstore_logger.setLevel(vllm_logger.level)
    kvstore_logger.propagate = False


def _require_blend_server(link: StoreLink) -> None:
    """Refuse to start a blending engine on a server without the content index (a store that is down now is
    checked by its first lookup instead: a content lookup it refuses is then an outage, logged once)."""
    blend = link.call("features", lambda client: client.server.features.blend)
    if blend is False:
        link.close()
        raise ValueError(
            f"KVStoreConnector: kvstore.blend needs a server started with --enable-blend; {link.url} was not "
            "(restart it with --enable-blend, or turn kvstore.blend off)"
        )


def _require_chunk_cut(link: StoreLink, settings: ConnectorSettings) -> None:
    """Refuse a private server that cuts chunks otherwise than ``kvstore.chunk_separator`` and ``kvstore.chunking``
    say (one left running from an earlier start with other settings); a shared server's own flags rule."""
    server = link.call("hello", lambda client: client.server)
    if server is None:
        return
    separator, chunking = tuple(server.chunk_separator), server.chunking.value
    if settings.url is not None:
        logger.info("KVStoreConnector: %s cuts chunks %s%s", link.url, chunking,
                    f" and after the separator {list(separator)}" if separator else "")  # fmt: skip
        return
    expected = settings.embedded.chunk_separator or ()
    wanted_rule = settings.embedded.chunking
    if separator == expected and wanted_rule in (None, chunking):
        return
    link.close()
    if separator != expected:
        found, asked = f"after separator {list(separator)}", f"kvstore.chunk_separator's {list(expected)}"
    else:
        found, asked = f"by the {chunking} rule", f"kvstore.chunking's {wanted_rule}"
    raise ValueError(
        f"KVStoreConnector: the kvstore server on {settings.embedded.settled_data_dir} cuts chunks {found}, not "
        f"{asked}; stop it (kvstore serve from an earlier start) so the engine starts its own"
    )


def _connected_links(
    settings: ConnectorSettings, layout: KVLayout, names: Sequence[str], timeout_s: float
) -> tuple[StoreLink, ...]:
    """Links that have tried the store once, together: a wrong layout or a refused embedded server fails the
    engine's start, a store that is merely down does not (the engine serves without it until it returns)."""
    try:
        links, reached = connect_links(settings, layout, names, timeout_s=timeout_s)
    except KVStoreError as exc:
        raise ValueError(f"KVStoreConnector: {exc}") from None
    if not reached:
        logger.warning("KVStoreConnector: the store is not reachable yet; starting without it")
    return links
