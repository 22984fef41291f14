"""The connector's scheduler side under vLLM's real ``Scheduler`` with its hybrid KV cache manager: three KV cache
groups over SmolLM2's 30 layers (two sliding-window groups of a 40-token window, one full-attention group; blocks of
16 tokens, the store's chunks of 32), as vLLM hands them to a ``SupportsHMA`` connector.

What is checked: a load carries every group's blocks, the sliding groups' null outside the window, and is
asynchronous (vLLM takes a hybrid engine's failed load only whole); a prefill over several steps saves in the
steps after which vLLM would free a sliding block the save needs, every block id of every save one vLLM holds in
that step (read from vLLM's own manager), and the saves together cover every chunk of the prompt; a save that would
need a block vLLM never held (its own prefix hit, outside the window) ends there, counted as
``unsaved_sliding_window``.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.request import RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvstore import KVLayout
from kvstore.connectors.vllm.metadata import SaveSpec
from tests.server.conftest import ServerProcess
from tests.vllm.connectors.test_scheduler_side import (
    CHUNK_SIZE,
    EngineShape,
    SchedulerFactory,
    _frozen_heap,  # noqa: F401  (fixtures, used by name)
    _none_hash,  # noqa: F401
    add_request,
    finish_step,
    layout,  # noqa: F401
    metadata_of,
    open_plans,
    preload,
    prompt,
    store,  # noqa: F401
    vllm_config,
    worker_loads,
)

BLOCK_SIZE = 16
WINDOW = 40  # longer than a chunk (32): every chunk can be saved while its blocks are held
NUM_GROUPS = 3  # layers i % 3: groups 0 and 1 sliding, group 2 full attention
FULL_GROUP = 2


@pytest.fixture
def make_hybrid(vllm_model_dir: Path, layout: KVLayout) -> Iterator[SchedulerFactory]:  # noqa: F811
    schedulers: list[Scheduler] = []

    def make(url: str, *, max_num_batched_tokens: int = 1024, prefix_caching: bool = False) -> Scheduler:
        shape = EngineShape(
            block_size=BLOCK_SIZE,
            num_blocks=128,
            prefix_caching=prefix_caching,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        config = vllm_config(vllm_model_dir, shape, {"kvstore.url": url})
        assert config.scheduler_config.disable_hybrid_kv_cache_manager is False, "the connector is SupportsHMA"
        common = {
            "block_size": BLOCK_SIZE,
            "num_kv_heads": layout.num_kv_heads,
            "head_size": layout.head_dim,
            "dtype": torch.float32,
        }
        names = [f"model.layers.{index}.self_attn.attn" for index in range(layout.num_layers)]
        groups = [
            KVCacheGroupSpec(names[group::NUM_GROUPS], SlidingWindowSpec(sliding_window=WINDOW, **common))
            if group != FULL_GROUP
            else KVCacheGroupSpec(names[group::NUM_GROUPS], FullAttentionSpec(**common))
            for group in range(NUM_GROUPS)
        ]
        kv_cache_config = KVCacheConfig(num_blocks=shape.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK_SIZE,
            log_stats=True,
        )
        schedulers.append(scheduler)
        return scheduler

    yield make
    for scheduler in schedulers:
        scheduler.shutdown()
    gc.collect()


def held_block_ids(scheduler: Scheduler, request_id: str) -> tuple[list[int], ...]:
    """Every group's blocks as vLLM's manager holds them now (0: freed, or never held)."""
    return scheduler.kv_cache_manager.get_block_ids(request_id)


def assert_reads_only_held_blocks(scheduler: Scheduler, output: SchedulerOutput) -> list[SaveSpec]:
    saves = metadata_of(output).saves
    for save in saves:
        held = held_block_ids(scheduler, save.request_id)
        first, last = save.start // BLOCK_SIZE, -(-save.end // BLOCK_SIZE)
        for group, ids in enumerate(save.group_block_ids):
            assert list(ids) == held[group][first:last], f"group {group}: the save reads a block vLLM does not hold"
            assert 0 not in ids
    return saves


def test_a_load_carries_every_groups_blocks_null_outside_the_window_and_runs_async(
    make_hybrid: SchedulerFactory,
    store: ServerProcess,  # noqa: F811
    layout: KVLayout,  # noqa: F811
) -> None:
    tokens = prompt(150, seed=41)
    preload(store.url, layout, tokens[:128])
    scheduler = make_hybrid(store.url)
    add_request(scheduler, "hit", tokens)

    output = scheduler.schedule()

    (load,) = metadata_of(output).loads
    assert (load.start, load.end, load.is_async) == (0, 128, True)
    assert output.num_scheduled_tokens == {}, "an async load: the request waits for its KV"
    held = held_block_ids(scheduler, "hit")
    skipped_blocks = (128 - WINDOW + 1) // BLOCK_SIZE  # vLLM's rule: tokens [0, 89) skipped, five whole blocks
    for group, ids in enumerate(load.group_block_ids):
        assert list(ids) == held[group][:8]
        if group == FULL_GROUP:
            assert 0 not in ids
        else:
            assert list(ids[:skipped_blocks]) == [0] * skipped_blocks and 0 not in ids[skipped_blocks:]
    worker_loads(store.url, layout, load)
    finish_step(scheduler, output, finished_loads={"hit"}, finished_recving={"hit"})

    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"hit": 22}
    (save,) = assert_reads_only_held_blocks(scheduler, output)
    assert (save.start, save.end) == (128, 150)
    params = finish_step(scheduler, output)
    assert scheduler.requests["hit"].status is RequestStatus.RUNNING and not params
    assert open_plans(store.url) == 0


@pytest.mark.parametrize(
    ("step_tokens", "expected"),
    [
        # every save ends on a chunk boundary of the prompt (32 tokens): the next starts there
        pytest.param(64, [(0, 64), (64, 128), (128, 192), (192, 200)], id="chunk-aligned-steps"),
        # a save ending inside a chunk (80, 120) stored it partial: the next starts at that chunk's start
        pytest.param(40, [(0, 80), (64, 120), (96, 160), (160, 200)], id="steps-inside-chunks"),
    ],
)
def test_a_prefill_over_several_steps_saves_before_vllm_frees_a_block_it_needs(
    make_hybrid: SchedulerFactory,
    store: ServerProcess,  # noqa: F811
    step_tokens: int,
    expected: list[tuple[int, int]],
) -> None:
    tokens = prompt(200, seed=42)
    scheduler = make_hybrid(store.url, max_num_batched_tokens=step_tokens)
    add_request(scheduler, "long", tokens, max_tokens=2)
    saves: list[SaveSpec] = []
    for _ in range(-(-200 // step_tokens)):
        output = scheduler.schedule()
        saves += assert_reads_only_held_blocks(scheduler, output)
        finish_step(scheduler, output)
    assert [(save.start, save.end) for save in saves] == expected
    assert all(save.token_ids == tuple(tokens[: save.end]) for save in saves)
    # every chunk of the prompt lies whole inside one save: [0, 32) [32, 64) in the first, ... [192, 200) in the last
    for chunk_start in range(0, 200, CHUNK_SIZE):
        chunk_end = min(chunk_start + CHUNK_SIZE, 200)
        assert any(save.start <= chunk_start and chunk_end <= save.end for save in saves), chunk_start
    assert held_block_ids(scheduler, "long")[0][0] == 0, "vLLM did free the sliding window's first blocks"
    output = scheduler.schedule()  # decode
    assert metadata_of(output).saves == []


def test_a_save_that_would_need_a_block_vllm_never_held_ends_there_counted(
    make_hybrid: SchedulerFactory,
    store: ServerProcess,  # noqa: F811
) -> None:
    shared = prompt(96, seed=43)
    scheduler = make_hybrid(store.url, prefix_caching=True)
    add_request(scheduler, "first", shared + prompt(40, seed=44), max_tokens=1)
    first = scheduler.schedule()
    assert [(save.start, save.end) for save in metadata_of(first).saves] == [(0, 136)]
    finish_step(scheduler, first)  # finished; no worker stored it, so the store still lacks it
    add_request(scheduler, "second", shared + prompt(60, seed=45), max_tokens=1)

    second = scheduler.schedule()

    assert second.scheduled_new_reqs[0].num_computed_tokens == 96, "vLLM's own hit"
    assert metadata_of(second).saves == [], "the sliding groups hold nothing of [0, 57): not saved"
    stats: list[dict[str, object]] = []
    finish_step(scheduler, second, connector_stats=stats)
    assert any(entry.get("unsaved_sliding_window") == 156 for entry in stats), stats
