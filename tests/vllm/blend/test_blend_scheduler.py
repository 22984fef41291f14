"""The scheduler side of blending under vLLM's real ``Scheduler`` (no model): what a prompt with cached documents at
new positions becomes (its blended span as external tokens, one ``BlendSpec``, no pin), the per-request controls, and
the report in the response (also for a request that finishes in its blend step).

The store is a real ``kvstore serve`` with ``--enable-blend``, preloaded with random KV (chunks of 32 tokens); the
engine's blocks hold 16 tokens. Documents are stored alone, from position 0, and prompts put them elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from kvstore import KVLayout
from kvstore.blend.vllm.hook import BlendOutcome
from kvstore.connectors.vllm.metadata import BlendSpec
from tests.server.conftest import ServerProcess, running_server
from tests.vllm.connectors.test_scheduler_side import (  # noqa: F401  (fixtures)
    STORE_FLAGS,
    SchedulerFactory,
    _frozen_heap,
    _none_hash,
    finish_step,
    layout,
    make_scheduler,
    metadata_of,
    new_request_blocks,
    num_computed_at_admission,
    open_plans,
    preload,
    prompt,
)

OUTCOME = BlendOutcome(exact_tokens=64, blend_tokens=64, gap_tokens=0, recomputed_tokens=11, skipped_disk_tokens=0)


@pytest.fixture(scope="module")
def blend_store(tmp_path_factory: pytest.TempPathFactory, layout: KVLayout) -> Iterator[ServerProcess]:  # noqa: F811
    with running_server(
        tmp_path_factory.mktemp("blend-store") / "data", *STORE_FLAGS, "--enable-blend", layout=layout
    ) as server:
        yield server


def add_request(
    scheduler: Scheduler, request_id: str, tokens: list[int], *, max_tokens: int = 8, params: Any = None
) -> Request:
    extra = None if params is None else {"kv_transfer_params": params}
    request = Request(
        request_id,
        tokens,
        SamplingParams(max_tokens=max_tokens, extra_args=extra),
        None,
        block_hasher=get_request_block_hasher(scheduler.block_size, get_hash_fn_by_name("sha256")),
    )
    scheduler.add_request(request)
    return request


@pytest.fixture
def documents(blend_store: ServerProcess, layout: KVLayout, request: pytest.FixtureRequest) -> tuple[list[int], ...]:  # noqa: F811
    """Two 64-token documents stored alone (two chunks each), distinct per test."""
    seed = 1000 + len(request.node.name)
    first, second = prompt(64, seed=seed), prompt(64, seed=seed + 1)
    preload(blend_store.url, layout, first)
    preload(blend_store.url, layout, second)
    return first, second


def test_a_prompt_with_a_document_at_a_new_position_is_one_blend_span_without_a_pin(
    make_scheduler: SchedulerFactory, blend_store: ServerProcess, documents: tuple[list[int], ...]  # noqa: F811
) -> None:
    first, second = documents
    tokens = first + second + prompt(40, seed=7)  # first is an exact prefix; second sits at 64, cached at 0
    scheduler = make_scheduler(blend_store.url, blend=True)
    add_request(scheduler, "blend", tokens, max_tokens=1)

    output = scheduler.schedule()

    assert num_computed_at_admission(output, "blend") == 128, "the span ends where the second document ends"
    assert output.num_scheduled_tokens == {"blend": len(tokens) - 128}
    assert output.has_sync_kv_loads
    blocks = new_request_blocks(output, "blend")
    metadata = metadata_of(output)
    assert metadata.loads == [] and metadata.saves == [], "a blended prompt is not stored (approximate KV)"
    assert metadata.blends == [
        BlendSpec(
            request_id="blend", token_ids=tuple(tokens), block_ids=tuple(blocks[:8]), local_end=0, end=128, ratio=0.15
        )
    ]
    assert open_plans(blend_store.url) == 0, "no pin: the worker's pass looks the prompt up itself"

    # one new token: it finishes in its blend step
    params = finish_step(scheduler, output, finished_blends={"blend": OUTCOME})

    report = params["blend"]["kvstore"]
    assert report["loaded_tokens"] == 128
    assert report["blend"]["exact_tokens"] == 64 and report["blend"]["blended_tokens"] == 64
    assert report["blend"]["recomputed_tokens"] == 11 and report["blend"]["reused_tokens"] == 117
    assert report["blend"]["computed_by_vllm"] == len(tokens) - 128
    # the span's cached tokens are served; the question after it was never stored
    assert (report["looked_up_tokens"], report["missed_tokens"]) == (len(tokens), 40)
    assert report["miss_reasons"] == {"never_stored": 40}


def test_a_request_that_opts_out_or_a_deployment_without_blend_takes_the_exact_prefix_only(
    make_scheduler: SchedulerFactory, blend_store: ServerProcess, documents: tuple[list[int], ...]  # noqa: F811
) -> None:
    first, second = documents
    tokens = first + second + prompt(40, seed=8)
    blending = make_scheduler(blend_store.url, blend=True)
    add_request(blending, "out", tokens, params={"kvstore": {"blend": False}})
    plain = make_scheduler(blend_store.url)
    add_request(plain, "asks", tokens, params={"kvstore": {"blend": True}})

    for scheduler, request_id in ((blending, "out"), (plain, "asks")):
        output = scheduler.schedule()
        assert num_computed_at_admission(output, request_id) == 64, "the first document only: an exact load"
        metadata = metadata_of(output)
        assert metadata.blends == [] and [load.end for load in metadata.loads] == [64]
        scheduler.finish_requests(request_id, scheduler.requests[request_id].status.FINISHED_ABORTED)


def test_a_bad_ratio_is_ignored_and_named_and_a_good_one_is_used(
    make_scheduler: SchedulerFactory, blend_store: ServerProcess, documents: tuple[list[int], ...]  # noqa: F811
) -> None:
    first, second = documents
    scheduler = make_scheduler(blend_store.url, blend=True, blend_ratio=0.3, blend_passes_per_step=2)
    add_request(scheduler, "bad", second + first + prompt(40, seed=9), max_tokens=1,
                params={"kvstore": {"blend_ratio": 7}})  # fmt: skip
    add_request(scheduler, "good", first + prompt(8, seed=3) + second + prompt(40, seed=10), max_tokens=1,
                params={"kvstore": {"blend_ratio": 1.0, "blend_report_selection": True}})  # fmt: skip

    output = scheduler.schedule()

    ratios = {spec.request_id: (spec.ratio, spec.report_selection) for spec in metadata_of(output).blends}
    assert ratios == {"bad": (0.3, False), "good": (1.0, True)}
    params = finish_step(scheduler, output, finished_blends={"bad": OUTCOME, "good": OUTCOME})
    assert params["bad"]["kvstore"]["notes"] == ["ignored blend_ratio=7: not a valid value"]
    assert "notes" not in params["good"]["kvstore"]


def test_a_failed_pass_is_recomputed_by_vllm_and_never_blended_again(
    make_scheduler: SchedulerFactory, blend_store: ServerProcess, documents: tuple[list[int], ...]  # noqa: F811
) -> None:
    first, second = documents
    tokens = first + second + prompt(40, seed=11)
    scheduler = make_scheduler(blend_store.url, blend=True)
    add_request(scheduler, "fails", tokens, max_tokens=1)
    output = scheduler.schedule()
    (spec,) = metadata_of(output).blends

    params = finish_step(scheduler, output, finished_blends={"fails": None}, invalid_block_ids=spec.block_ids)
    assert params == {}, "vLLM reschedules it to recompute the failed blocks"
    again = scheduler.schedule()
    assert metadata_of(again).blends == [] and again.num_scheduled_tokens == {"fails": len(tokens)}
    params = finish_step(scheduler, again)
    assert params["fails"]["kvstore"]["blend"] == {"failed": True, "span_tokens": 128, "local_tokens": 0}
    assert params["fails"]["kvstore"]["load_failed_tokens"] == 128
    assert params["fails"]["kvstore"]["miss_reasons"] == {"load_failed": 128, "never_stored": 40}


@pytest.mark.parametrize("passes_per_step", [1, 2])
def test_a_step_runs_at_most_blend_passes_per_step_and_the_rest_wait_for_the_next(
    make_scheduler: SchedulerFactory,  # noqa: F811
    blend_store: ServerProcess,
    documents: tuple[list[int], ...],
    passes_per_step: int,
) -> None:
    """Every request decoding in a step waits for all of its passes: over the bound a request is asked about again
    in a later step (and blended then), never sent to a plain prefill."""
    first, second = documents
    scheduler = make_scheduler(blend_store.url, blend=True, blend_passes_per_step=passes_per_step)
    for number in range(2):
        add_request(scheduler, f"q{number}", first + second + prompt(40, seed=20 + number), max_tokens=2)

    output = scheduler.schedule()

    blended = [spec.request_id for spec in metadata_of(output).blends]
    assert blended == ["q0", "q1"][:passes_per_step]
    assert set(output.num_scheduled_tokens) == set(blended), "the request over the bound is not scheduled at all"
    finish_step(scheduler, output, finished_blends=dict.fromkeys(blended, OUTCOME))
    if passes_per_step == 1:
        later = scheduler.schedule()
        assert [spec.request_id for spec in metadata_of(later).blends] == ["q1"]
        assert num_computed_at_admission(later, "q1") == 128, "blended in the next step, its span the same"
        assert set(later.num_scheduled_tokens) == {"q0", "q1"}, "q0 decodes in the step of q1's pass"
