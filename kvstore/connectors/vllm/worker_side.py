"""The connector's worker half (vLLM's worker process): KV between the store and vLLM's paged blocks.

Loads. A synchronous load (the hit is in a memory tier) is fetched on a background thread as soon as the step starts
(``start_load_kv``): one retrieve of the plan the scheduler pinned and handed over (``LoadSpec.plan``; a lookup of
its own only when there is none) into a shared-memory buffer the server writes directly (kept for the next load:
``LoadBuffers``). Entering the first attention layer (``wait_for_layer_load``) waits for that fetch and scatters
every layer into the request's blocks at once (one kernel launch on CUDA, ``PagedChunk.scatter_all``: the copies
run in order with the forward pass either way, on the engine's stream or thread, so copying layer ``l`` just before
its attention would only add launches and Python calls on the engine's thread). An asynchronous load (the hit is on
disk) runs whole on its own thread while the engine keeps stepping other requests, and is reported done through
``get_finished``.

Saves (``PromptSaves``). In the step that completes a prompt's prefill, leaving each attention layer
(``save_kv_layer``) counts that layer as computed; after the forward pass (``wait_for_save``) the KV of the chunks the
store lacks is gathered out of the blocks of every layer at once (on a CPU cache by a gather thread, off the step's
path; the next step waits for it in ``bind``) and goes to the store on the save thread.

Faults. A load that finds less than the scheduler planned (a chunk evicted or corrupt in between, the store gone)
loads what it has and reports the other blocks through ``get_block_ids_with_load_errors``: with vLLM's
``kv_load_failure_policy="recompute"`` those blocks are recomputed and the request completes with the right
output. A save that fails is logged and dropped (a later prompt misses, nothing else). A store that is down costs
nothing per request (``StoreLink``), and the engine's thread never waits on one that does not answer for longer than
``lookup_timeout_s``: a sync load's lookup gives up after it (the thread waits for that fetch), and a save stages
without asking the store.

Blends (``kvstore.blend``). A request's blend span runs whole in ``start_load_kv``, before the step's forward: the blend
engine (registered by kvstore's vLLM plugin, ``kvstore.blend.vllm.hook``) looks the prompt up, runs the layerwise pass
on the engine's own model and writes the span's KV into the request's blocks (``PagedSpanWriter``); vLLM's forward then
computes the rest of the prompt over it. A pass that fails reports its blocks as failed, and vLLM recomputes them.

Copies between blocks and chunks use the block format read from the backend at ``register_kv_caches``
(``kvstore.connectors.block_format``, copied by ``kvstore.connectors.paged``): one kernel for every layer where Triton
runs (CUDA), else one ``index_select`` / ``index_copy_`` per layer (per K/V plane where the planes do not fuse).
Under vLLM's hybrid KV cache manager (several KV cache groups, ``kv_groups``) each layer goes through its own
group's blocks (``kvstore.connectors.group_copies``: a kernel launch per run of evenly spaced layers of a group), a
load skipping the null blocks outside a sliding window, and a load that falls short fails whole (the scheduler side
makes those loads asynchronous: vLLM maps no failed block id to a group).

Tensor and pipeline parallelism: each worker (rank) moves only its part of every chunk, its stage's layers times its
shard's KV heads (``kvstore.connectors.vllm.parallel``): its saves send that part (the server commits a chunk once
every rank's part has arrived), its loads retrieve that part of the plan the scheduler pinned (the server keeps the
pins until every rank's part is done). Every rank reports its own loads to vLLM, whose aggregator waits for all.
With several KV cache groups every rank gets every group's block ids (the scheduler's; vLLM gives every worker the
same groups) and copies its own layers and heads through its own groups' blocks; an async load that falls short on
one rank fails the request's load on all (vLLM's aggregator joins the ranks' ``failed_recving``).

Threads: vLLM calls every method on its model-runner thread; fetches and stores run on three single-thread pools
(sync loads, async loads, and ``PromptSaves``'s saves), each with its own ``StoreLink`` so one never queues behind
another, and on a CPU cache ``PromptSaves`` gathers on a thread of its own. The counters are a ``WorkerStats``
(locked inside); ``_load_misses_lock`` guards ``_load_misses``, which the async-load thread adds to.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvstore.blend.vllm.hook import BlendEngine, BlendEngineContext, BlendOutcome, blend_engine_factory
from kvstore.client import Client
from kvstore.connectors.block_format import BlockFormat, PlaneMap
from kvstore.connectors.group_copies import GroupCopies
from kvstore.connectors.lent_scatter import compile_lent_scatter, scatter_lent
from kvstore.connectors.load_buffers import LoadBuffers
from kvstore.connectors.paged import PagedChunk, PagedLayers, device_block_ids
from kvstore.connectors.settings import ConnectorSettings
from kvstore.connectors.store_link import StoreLink
from kvstore.connectors.vllm.cache_shapes import check_layer_scales, expected_cache_shape, probe_engine_block_format
from kvstore.connectors.vllm.kv_groups import KVGroups
from kvstore.connectors.vllm.metadata import (
    BlendSpec,
    KVStoreConnectorMetadata,
    KVStoreConnectorStats,
    KVStoreWorkerMetadata,
    LoadSpec,
)
from kvstore.connectors.vllm.parallel import RankPart, rank_part
from kvstore.connectors.vllm.prompt_saves import PromptSaves
from kvstore.connectors.vllm.span_writer import PagedSpanWriter
from kvstore.connectors.vllm.worker_stats import WorkerStats
from kvstore.errors import ConfigError, KVStoreError
from kvstore.layout import KVLayout
from kvstore.misses import Miss, tokens_by_reason
from kvstore.plan import LookupPlan
from kvstore.wire.lent_kv import LentKV

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["FinishedLoads", "WorkerSide"]

logger = logging.getLogger(__name__)


@dataclass(slots=True, kw_only=True)
class _Fetched:
    """A load's KV as retrieved: ``kv`` covers tokens ``[spec.start, loaded_end)`` at least, from index 0 (``None``
    when nothing); ``buffer`` is the load buffer it lies in, to give back once the KV is in the blocks;
    ``block_ids``: the blocks the loaded tokens fill, on the cache's device (made on the fetch thread, not on the
    engine's); with several KV cache groups ``None``, and the scatter binds each group's blocks itself."""

    kv: torch.Tensor | None
    loaded_end: int
    seconds: float
    buffer: torch.Tensor | None = None
    block_ids: torch.Tensor | None = None
    misses: tuple[Miss, ...] = ()  # the retrieve's (or the plan's), with their reasons
    lent: LentKV | None = None  # instead of ``kv``: the server's own memory, read until ``return_loan``
    return_loan: Callable[[], None] | None = None  # hands a lent plan back (once its KV is in the blocks)

    def give_back_loan(self) -> None:
        """Return the lent plan, if any (once): the server may reuse its slots from then on."""
        give_back, self.return_loan = self.return_loan, None
        if give_back is not None:
            give_back()


@dataclass(frozen=True, slots=True, kw_only=True)
class FinishedLoads:
    """The async loads that finished since the last look (``WorkerSide.get_finished``).

    ``finished``: every one, whatever it loaded (vLLM lets a request out of its wait for KV only when its id comes
    back as finished, failed or not). ``failed``: those of them that put none of their planned tokens into the
    blocks (the store was gone, the load raised, the chunks were evicted): vLLM's ``failed_recving``. A load that
    fell short part-way is not among them: its blocks past what it loaded are reported one by one
    (``take_failed_blocks``), so vLLM keeps the part it did load and recomputes only the rest; ``failed_recving``
    drops the whole load.
    """

    finished: frozenset[str] = frozenset()
    failed: frozenset[str] = frozenset()


class WorkerSide:
    """The worker half of ``KVStoreConnector``.

    Args:
        vllm_config: the engine's config (to find its attention layers).
        layout: the model's KV layout.
        links: ``(sync loads, async loads, saves)`` links to the store.
        block_size: vLLM's block size.
        blend_link: the link blend passes use (``None``: blending is off).
        settings: the connector's settings (the blend check layer and disk policy).
        wait_for_saves: finish each step only once its saves are in the store (a prefill engine, ``kv_producer``:
            its answer tells a prefill/decode proxy that the decode engine can load the prompt now); otherwise a
            save lands some milliseconds after its step, which only a request racing it notices.
        groups: the engine's KV cache groups (``None``: one, every layer): with several, each layer is copied
            through its own group's blocks, and a load that falls short fails whole (vLLM takes no failed block ids
            from a hybrid engine; the scheduler side makes every such load asynchronous).
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        layout: KVLayout,
        links: tuple[StoreLink, StoreLink, StoreLink],
        *,
        block_size: int,
        blend_link: StoreLink | None = None,
        settings: ConnectorSettings | None = None,
        wait_for_saves: bool = False,
        groups: KVGroups | None = None,
    ) -> None:
        self._vllm_config = vllm_config
        self._groups = groups
        self._hybrid = groups is not None and groups.hybrid
        self._copies: GroupCopies | None = None
        self._wait_for_saves = wait_for_saves
        self._settings = settings or ConnectorSettings()
        self._blend_link = blend_link
        self._blend_engine: BlendEngine | None = None
        self._finished_blends: dict[str, BlendOutcome | None] = {}
        self._layout = layout
        self._sync_link, self._async_link, self._save_link = links
        self._block_size = block_size
        self._pools = tuple(
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"kvstore-{name}")
            for name in ("load", "async-load")
        )
        self._caches: list[torch.Tensor] = []
        self._rank = RankPart(part=None, shape=layout)  # this worker's part of every chunk (register_kv_caches)
        self._layers: PagedLayers | None = None
        self._layer_of: dict[str, int] = {}
        self._metadata: KVStoreConnectorMetadata | None = None
        self._sync_loads: list[tuple[LoadSpec, concurrent.futures.Future[_Fetched]]] = []
        self._sync_loads_scattered = False
        self._async_loads: dict[str, concurrent.futures.Future[tuple[int, set[int]]]] = {}
        self._saves: PromptSaves | None = None  # once the caches are registered
        self._step_started: float | None = None
        self._prefill_steps: list[tuple[float, int]] = []  # (ms, tokens) of plain steps, for the blend gate
        self._sync_buffers, self._async_buffers = LoadBuffers(), LoadBuffers()  # one per load link and thread
        self._failed_blocks: set[int] = set()
        self._finished_loads: dict[str, int] = {}  # request id -> tokens its load put into the blocks
        self._load_misses_lock = threading.Lock()
        self._load_misses: dict[str, dict[str, int]] = {}  # request id -> why its load fell short (tokens by reason)
        self._stats = WorkerStats()

    # -- set-up ---------------------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Order the layers as the model does and read the block format from the attention backend.

        Raises:
            ConfigError: the layer count, shape or dtype disagrees with the layout, or the backend's block format is
                not one kvstore can copy.
        """
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        self._rank = self._rank_part([extract_layer_index(name) for name in names])
        layout = self._rank.shape  # this rank's layers and KV heads
        if len(names) != layout.num_layers:
            raise ConfigError(f"vLLM registered {len(names)} KV cache layers; the layout has {layout.num_layers}")
        self._caches = [kv_caches[name] for name in names]
        self._layer_of = {name: index for index, name in enumerate(names)}
        first = self._caches[0]
        expected = expected_cache_shape(layout, self._block_size)  # an MLA latent or K/V (fp8 included)
        for name, cache in zip(names, self._caches, strict=True):
            if cache.dim() != 4 or tuple(cache.shape[1:]) != expected:
                raise ConfigError(
                    f"vLLM KV cache {name} has shape {list(cache.shape)}; kvstore reads [blocks, {expected[0]} kv "
                    f"heads, {expected[1]} slots, {expected[2]}] (vLLM 0.32 to 0.34)"
                )
            if cache.dtype != layout.dtype.torch_dtype or cache.stride() != first.stride():
                raise ConfigError(f"vLLM KV cache {name} is {cache.dtype}; the layout says {layout.dtype.value}")
        check_layer_scales(self._attention_layers(names), layout)  # fp8: the layers' scales are the layout's
        block_format = self._read_block_format(names[0], first)
        self._layers = PagedLayers.of(self._caches, block_format)
        self._layers.check_request_kernel(block_id=0)  # vLLM never hands block 0 to a request
        groups = self._groups if self._hybrid else None
        if groups is None:
            self._copies = GroupCopies(self._layers, [0] * len(names))
        else:  # every group's block ids come to every rank; a pipeline stage may hold no layer of some groups
            self._copies = GroupCopies(self._layers, groups.group_of_layers(names), num_groups=len(groups.groups))
        if first.device.type == "cpu" and not self._hybrid:
            compile_lent_scatter(self._layers)  # now, not in the first lent load's step
        self._saves = PromptSaves(
            self._save_link, self._layers, self._copies, self._rank, self._stats, wait_for_saves=self._wait_for_saves
        )
        logger.info(
            "kvstore: %d layers of paged KV, %s; %s; %s; %s",
            len(names),
            block_format.describe(),
            "one launch copies every layer" if self._layers.request_kernel is not None else "copies go layer by layer",
            f"{self._copies.num_groups} KV cache groups",
            "the whole chunk" if self._rank.part is None else f"this rank's part: {self._rank.part.describe()}",
        )
        if self._blend_link is not None:
            self._blend_engine = self._build_blend_engine(tuple(names))

    def _rank_part(self, layer_indexes: list[int]) -> RankPart:
        """This worker's part of every chunk: its registered layers, and its tensor-parallel shard's KV heads."""
        tp_size = self._vllm_config.parallel_config.tensor_parallel_size
        tp_rank = 0
        if tp_size > 1:  # the group exists in an engine's worker only
            from vllm.distributed import get_tensor_model_parallel_rank

            tp_rank = get_tensor_model_parallel_rank()
        return rank_part(
            self._layout,
            layer_indexes,
            tp_rank=tp_rank,
            tp_size=tp_size,
            mla=bool(getattr(self._vllm_config.model_config, "use_mla", False)),
        )

    def _build_blend_engine(self, layer_names: tuple[str, ...]) -> BlendEngine:
        """The plugin's blend engine on this worker's model (it checks the model and its RoPE, one line if not).

        Raises:
            ConfigError: no plugin registered an engine, or the engine refused the model.
        """
        factory = blend_engine_factory()
        if factory is None:
            raise ConfigError(
                "kvstore.blend needs kvstore's vLLM plugin (the vllm.general_plugins entry point kvstore_blend), which "
                "did not load in this worker: reinstall kvstore in this environment, and keep kvstore_blend in "
                "VLLM_PLUGINS if you set it"
            )
        settings = self._settings
        context = BlendEngineContext(
            engine_config=self._vllm_config,
            layout=self._layout,
            part=self._rank.part,
            span_writer=PagedSpanWriter(self._registered_layers()),
            buffers=LoadBuffers(),
            layer_names=layer_names,
            check_layer=settings.blend_check_layer,
            disk_policy=settings.blend_disk_policy,
            selection=settings.blend_selection,
            chunk_start_tokens=settings.blend_chunk_start_tokens,
        )
        return factory(context)

    def _read_block_format(self, name: str, cache: torch.Tensor) -> BlockFormat:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        layer = get_layers_from_vllm_config(self._vllm_config, AttentionLayerBase).get(name)  # type: ignore[type-abstract]
        layout = self._rank.shape
        probed = probe_engine_block_format(
            layer, cache, layout, block_size=self._block_size, model_dtype=self._vllm_config.model_config.dtype
        )
        if probed is None:  # backends that write inside attention (FlashInfer): the documented packed format
            return _packed_format(cache, self._block_size, layout.num_kv_heads, layout.head_dim)
        return probed

    def _attention_layers(self, names: Sequence[str]) -> list[object]:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        layers = get_layers_from_vllm_config(self._vllm_config, AttentionLayerBase)  # type: ignore[type-abstract]
        return [layers.get(name) for name in names]

    # -- a step ---------------------------------------------------------------------------------------------------

    def bind(self, metadata: KVStoreConnectorMetadata) -> None:
        """A new step: forget the last one's per-step state (loads and saves of a step finish within it)."""
        self._metadata = metadata
        self._sync_loads = []
        self._sync_loads_scattered = False
        if self._saves is not None:
            self._saves.new_step()
        # A plain step (no load, no pass): its time from here (before the forward; vLLM calls start_load_kv after
        # the forward when a step has no sync load) to wait_for_save is the engine's own compute.
        self._step_started = None if metadata.blends or metadata.loads else time.perf_counter()

    def start_load_kv(self) -> None:
        metadata = self._metadata
        if metadata is None:
            return
        for blend in metadata.blends:
            self._blend(blend)
        for spec in metadata.loads:
            if spec.is_async:
                self._async_loads[spec.request_id] = self._pools[1].submit(self._load_whole, spec)
            else:
                fetch = self._pools[0].submit(self._fetch, self._sync_link, self._sync_buffers, spec)
                self._sync_loads.append((spec, fetch))

    def wait_for_layer_load(self, layer_name: str) -> None:
        if layer_name in self._layer_of:
            self._scatter_sync_loads()

    def save_kv_layer(self, layer_name: str) -> None:
        metadata = self._metadata
        layer = self._layer_of.get(layer_name)
        if metadata is None or layer is None or not metadata.saves or not self._rank.saves or self._saves is None:
            return
        self._saves.layer_computed(layer, metadata.saves)

    def wait_for_save(self) -> None:
        """Finish the step: every planned layer of every sync load is in place, saves leave on their thread."""
        self._scatter_sync_loads()
        for spec, future in self._sync_loads:
            fetched = future.result()
            self._finished_loads[spec.request_id] = _loaded_tokens(spec, fetched)
            self._sync_buffers.give_back(fetched.buffer)
        self._sync_loads = []
        if self._step_started is not None and self._metadata is not None:
            step_ms = 1000.0 * (time.perf_counter() - self._step_started)
            self._prefill_steps.append((step_ms, self._metadata.step_tokens))
            self._step_started = None
        if self._saves is not None:
            self._saves.finish_step()

    def get_finished(self) -> FinishedLoads:
        """Async loads that finished since the last call, and which of them failed (their failed blocks are reported
        with them: vLLM reads those after this, in the same step)."""
        done = [request_id for request_id, future in self._async_loads.items() if future.done()]
        failed: set[str] = set()
        for request_id in done:
            num_loaded, failed_blocks = self._async_loads.pop(request_id).result()
            if failed_blocks and self._hybrid:  # vLLM maps no failed block id to a group: the load fails whole
                num_loaded, failed_blocks = 0, set()
                failed.add(request_id)
            self._failed_blocks |= failed_blocks
            self._finished_loads[request_id] = num_loaded
            if failed_blocks and not num_loaded:
                failed.add(request_id)
        return FinishedLoads(finished=frozenset(done), failed=frozenset(failed))

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def take_worker_metadata(self) -> KVStoreWorkerMetadata | None:
        if not self._finished_loads and not self._finished_blends and not self._prefill_steps:
            return None
        finished, self._finished_loads = self._finished_loads, {}
        blends, self._finished_blends = self._finished_blends, {}
        steps, self._prefill_steps = self._prefill_steps, []
        with self._load_misses_lock:  # an async load's thread adds to it
            misses, self._load_misses = self._load_misses, {}
        return KVStoreWorkerMetadata(
            finished_loads=finished, finished_blends=blends, prefill_steps=steps, load_misses=misses
        )

    def record_on_path(self, seconds: float) -> None:
        """Count the time the engine's thread spent in this step's hooks (``HookClock``)."""
        if seconds:
            self._stats.record(on_path_seconds=seconds)

    def take_stats(self) -> KVStoreConnectorStats | None:
        return self._stats.take()

    def close(self) -> None:
        """Finish pending saves and loads, then close the links."""
        for pool in self._pools:
            pool.shutdown(wait=True)
        if self._saves is not None:
            self._saves.close()
        if self._blend_engine is not None:
            self._blend_engine.close()
        for link in (self._sync_link, self._async_link, self._save_link, self._blend_link):
            if link is not None:
                link.close()

    # -- blends ---------------------------------------------------------------------------------------------------

    def _blend(self, spec: BlendSpec) -> None:
        """Run one request's blend pass on the engine's thread; a pass that fails leaves its blocks to vLLM."""
        engine, link = self._blend_engine, self._blend_link
        started = time.perf_counter()
        outcome: BlendOutcome | None = None
        if engine is not None and link is not None:
            try:
                outcome = link.call(
                    "blend",
                    lambda client: engine.run(
                        client,
                        token_ids=spec.token_ids,
                        block_ids=spec.block_ids,
                        local_end=spec.local_end,
                        end=spec.end,
                        ratio=spec.ratio,
                        report_selection=spec.report_selection,
                    ),
                )
            except Exception:  # the pass's boundary: vLLM recomputes the span, the engine goes on
                logger.exception("request %s: the blend pass failed; vLLM recomputes its blocks", spec.request_id)
        seconds = time.perf_counter() - started
        if outcome is None:
            logger.warning("request %s: not blended; vLLM recomputes tokens [%d, %d)", spec.request_id,
                           spec.local_end, spec.end)  # fmt: skip
            self._failed_blocks |= set(spec.block_ids)
        self._finished_blends[spec.request_id] = outcome
        if outcome is None:
            self._stats.record(blend_failed=1)
        else:
            self._stats.record(
                blends=1,
                blended_tokens=spec.end - spec.local_end,
                blend_recomputed_tokens=outcome.recomputed_tokens,
                blend_seconds=seconds,
            )

    # -- loads ----------------------------------------------------------------------------------------------------

    def _fetch(self, link: StoreLink, buffers: LoadBuffers, spec: LoadSpec) -> _Fetched:
        """Retrieve the prompt's cached prefix; ``loaded_end`` says how far it is usable (block-aligned)."""
        started = time.perf_counter()
        try:
            fetched = link.call("load", lambda client: self._retrieve(client, spec, buffers))
        except Exception:  # the load thread's boundary: vLLM recomputes what did not load
            logger.exception("request %s: loading from the store failed; vLLM recomputes its blocks", spec.request_id)
            fetched = None
        seconds = time.perf_counter() - started
        return fetched if fetched is not None else _Fetched(kv=None, loaded_end=spec.start, seconds=seconds)

    def _retrieve(self, client: Client, spec: LoadSpec, buffers: LoadBuffers) -> _Fetched:
        started = time.perf_counter()
        plan, owner = spec.plan, spec.plan_owner  # the scheduler's pinned plan: retrieved or released here
        if plan is None:
            # a sync load's engine thread waits for this fetch: a store that does not answer a lookup costs it the
            # lookup timeout, not the transfer timeout
            plan = client.lookup(spec.token_ids, blend=False, timeout_s=self._settings.lookup_timeout_s, repeat=True)
        part = self._rank.part
        readers = spec.readers if spec.plan is not None else 1  # the scheduler's plan is every rank's; ours is ours
        usable = min(spec.end, plan.num_prefix_tokens)
        usable -= usable % self._block_size
        if usable <= spec.start:
            client.release(plan, owner=owner, readers=readers)
            return _Fetched(kv=None, loaded_end=spec.start, seconds=time.perf_counter() - started, misses=plan.misses)
        cpu = self._caches[0].device.type == "cpu"
        if cpu and not self._hybrid:
            lent = self._lend(client, spec, plan, readers, started)
            if lent is not None:
                return lent
        try:
            # vLLM holds [0, start) itself: only the rest travels
            out = buffers.take(client, plan.end - spec.start, part=part) if cpu else None
        except KVStoreError:
            client.release(plan, owner=owner, readers=readers)
            raise
        try:
            result = client.retrieve(plan, out, owner=owner, start=spec.start, part=part, readers=readers)
        except KVStoreError:
            if readers == 1:  # a shared plan counted this rank's retrieve as done, failed or not
                client.release(plan, owner=owner)
            buffers.give_back(out)
            raise
        usable = min(usable, result.num_prefix_tokens)  # a chunk that failed its checksum is a gap
        usable -= usable % self._block_size
        loaded_end = max(usable, spec.start)
        num_blocks = (loaded_end - spec.start) // self._block_size
        return _Fetched(
            kv=result.kv,
            loaded_end=loaded_end,
            seconds=time.perf_counter() - started,
            buffer=out,
            block_ids=None if self._hybrid else self._device_block_ids(spec.block_ids[:num_blocks]),
            misses=result.misses,
        )

    def _lend(self, client: Client, spec: LoadSpec, plan: LookupPlan, readers: int, started: float) -> _Fetched | None:
        """The load lent by a server on this host (``Client.lend``): the scatter reads the chunks where the server's
        cpu tier holds them, so the server copies nothing; ``None`` when it does not lend (the plan untouched)."""
        owner = spec.plan_owner
        try:
            lent = client.lend(plan, owner=owner, start=spec.start, part=self._rank.part, readers=readers)
        except KVStoreError:
            if readers == 1:
                client.release(plan, owner=owner)
            raise
        if lent is None:
            return None

        def return_loan() -> None:
            try:
                client.return_loan(plan, owner=owner)
            except KVStoreError as exc:  # a link that reconnected: its goodbye returned the loan
                logger.debug("request %s: returning its lent plan failed: %s", spec.request_id, exc)

        usable = min(spec.end, lent.num_prefix_tokens)
        loaded_end = max(usable - usable % self._block_size, spec.start)
        num_blocks = (loaded_end - spec.start) // self._block_size
        fetched = _Fetched(
            kv=None,
            lent=lent,
            return_loan=return_loan,
            loaded_end=loaded_end,
            seconds=time.perf_counter() - started,
            block_ids=self._device_block_ids(spec.block_ids[:num_blocks]),
            misses=lent.misses,
        )
        if not num_blocks:
            fetched.give_back_loan()
        return fetched

    def _scatter_sync_loads(self) -> None:
        """Once a step, on the engine's thread: wait for each sync load's fetch and put it into its blocks."""
        if self._sync_loads_scattered:
            return
        self._sync_loads_scattered = True
        for spec, future in self._sync_loads:
            fetched = future.result()
            try:
                self._account_load(spec, fetched)
                self._scatter(spec, fetched)
            finally:
                if fetched.return_loan is not None:  # off the engine's thread: a round trip to the server
                    self._pools[0].submit(fetched.give_back_loan)

    def _load_whole(self, spec: LoadSpec) -> tuple[int, set[int]]:
        """An async load: fetch, then scatter every layer; returns the tokens loaded and the blocks that were not."""
        fetched = landed = self._fetch(self._async_link, self._async_buffers, spec)
        try:
            self._scatter(spec, landed)
            if self._caches[0].device.type == "cuda":
                torch.cuda.current_stream(self._caches[0].device).synchronize()
        except Exception:  # the load thread's boundary: vLLM recomputes what did not load
            logger.exception("request %s: async load failed; vLLM recomputes its blocks", spec.request_id)
            fetched = _Fetched(kv=None, loaded_end=spec.start, seconds=0.0)
        finally:
            self._async_buffers.give_back(landed.buffer)
            landed.give_back_loan()  # failed or not: a loan never returned would pin its chunks for good
        return _loaded_tokens(spec, fetched), self._account_load(spec, fetched)

    def _scatter(self, spec: LoadSpec, fetched: _Fetched) -> None:
        """Every layer of a fetched load into its blocks (the retrieve began at ``spec.start``); with several KV
        cache groups each layer into its group's blocks, none into the null block (a sliding window's outside)."""
        if fetched.loaded_end <= spec.start:
            return
        if fetched.lent is not None:
            assert fetched.block_ids is not None, "a load is lent only to an engine of one KV cache group"
            layers = self._registered_layers()
            scatter_lent(layers, fetched.block_ids, fetched.lent.pieces, spec.start, fetched.loaded_end)
            return
        if fetched.kv is None:
            return
        kv = fetched.kv[:, :, : fetched.loaded_end - spec.start]
        if fetched.block_ids is not None:
            PagedChunk(self._registered_layers(), fetched.block_ids, kv).scatter_all()
            return
        num_blocks = (fetched.loaded_end - spec.start) // self._block_size
        group_block_ids = [ids[:num_blocks] for ids in spec.group_block_ids]
        self._group_copies().bind(group_block_ids, kv, load=True).scatter_all()

    def _group_copies(self) -> GroupCopies:
        assert self._copies is not None, "vLLM moves KV only after registering its caches"
        return self._copies

    def _registered_layers(self) -> PagedLayers:
        assert self._layers is not None, "vLLM moves KV only after registering its caches"
        return self._layers

    def _device_block_ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        return device_block_ids(block_ids, self._caches[0].device)

    def _account_load(self, spec: LoadSpec, fetched: _Fetched) -> set[int]:
        """Count a load and report the blocks it could not fill (once, when it is scattered)."""
        loaded_blocks = (fetched.loaded_end - spec.start) // self._block_size
        failed = set(spec.block_ids[loaded_blocks:])
        if failed:
            logger.warning(
                "request %s: the store had tokens [%d, %d) of the planned [%d, %d); vLLM recomputes %d blocks",
                spec.request_id,
                spec.start,
                fetched.loaded_end,
                spec.start,
                spec.end,
                len(failed),
            )
        # an async load's go with its finish (get_finished); a hybrid engine's loads are all async
        self._failed_blocks |= failed if not spec.is_async and not self._hybrid else set()
        num_tokens = _loaded_tokens(spec, fetched)
        leads = self._rank.leads  # requests and tokens once per engine; bytes (this rank's part) on every rank
        if failed:  # the scheduler names the rest of the shortfall (a failed call, a cut block) load_failed
            reasons = tokens_by_reason(fetched.misses, fetched.loaded_end, spec.end)
            with self._load_misses_lock:
                self._load_misses[spec.request_id] = {reason.value: count for reason, count in reasons.items()}
        self._stats.record(
            loads=int(leads),
            loaded_tokens=num_tokens if leads else 0,
            loaded_bytes=self._rank.shape.chunk_bytes(num_tokens),
            load_failed_blocks=len(failed) if leads else 0,
            load_seconds=fetched.seconds if leads else 0.0,
        )
        return failed


def _loaded_tokens(spec: LoadSpec, fetched: _Fetched) -> int:
    return fetched.loaded_end - spec.start


def _packed_format(cache: torch.Tensor, block_size: int, num_kv_heads: int, head_dim: int) -> BlockFormat:
    """vLLM 0.32 to 0.34's documented CUDA format: ``[blocks, heads, slots, K|V]`` with the tensor's own strides."""
    _, head_stride, token_stride, dim_stride = cache.stride()
    key = PlaneMap(offset=0, token_stride=token_stride, head_stride=head_stride, dim_stride=dim_stride)
    value = PlaneMap(
        offset=head_dim * dim_stride, token_stride=token_stride, head_stride=head_stride, dim_stride=dim_stride
    )
    return BlockFormat(block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim, key=key, value=value)
