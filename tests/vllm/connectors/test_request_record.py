"""``RequestRecord``: one request's phase moves only along the drawn transitions, and each transition keeps or drops
exactly what the scheduler side relies on (the pin until hand-over, the planned tokens until the report)."""

from __future__ import annotations

import pytest

from kvstore.blend.vllm.hook import BlendOutcome
from kvstore.connectors.vllm.metadata import BlendSpec, LoadSpec
from kvstore.connectors.vllm.request_misses import MissAccount
from kvstore.connectors.vllm.request_record import HeldPin, Probe, RequestPhase, RequestRecord
from kvstore.keys import PrefixKey
from kvstore.misses import MissReason
from kvstore.plan import LookupPlan, Segment
from kvstore.tiers.base import TierName

PROMPT = tuple(range(100))


def load_spec(start: int = 0, end: int = 64) -> LoadSpec:
    return LoadSpec(request_id="r", token_ids=PROMPT, block_ids=(1, 2, 3, 4), start=start, end=end, is_async=False)


def blend_spec() -> BlendSpec:
    return BlendSpec(request_id="r", token_ids=PROMPT, block_ids=(1, 2, 3), local_end=16, end=64, ratio=0.15)


def test_finished_is_a_comparison_as_in_vllm() -> None:
    finished = [phase for phase in RequestPhase if RequestPhase.is_finished(phase)]
    assert finished == [RequestPhase.FINISHED_AWAITING_BLEND]


def test_a_load_keeps_its_pin_until_handed_over_and_its_planned_tokens_until_reported() -> None:
    record = RequestRecord(prompt=PROMPT, account=MissAccount(segments=(), misses=(), local_end=0, num_tokens=100,
                                                              exact_end=64))  # fmt: skip
    record.admit()
    assert record.phase is RequestPhase.RUNNING
    pin = HeldPin(plan=LookupPlan(plan_id=1, session_id=None, num_query_tokens=100, segments=()), owner="token")
    record.queue_load(load_spec(), pin)
    assert (record.phase, record.pin, record.planned_load_tokens) == (RequestPhase.LOAD_QUEUED, pin, 64)
    record.hand_over()
    assert (record.phase, record.pin, record.planned_load_tokens) == (RequestPhase.LOADING, None, 64)
    record.finish_load(48, {"evicted_cpu": 8})
    assert (record.phase, record.transfer, record.loaded_tokens, record.load_failed_tokens) == (
        RequestPhase.RUNNING, None, 48, 16,
    )  # fmt: skip
    assert record.account is not None
    assert record.account.undelivered == {MissReason.EVICTED_CPU: 8, MissReason.LOAD_FAILED: 8}


def test_a_preempted_request_forgets_its_load_and_a_late_report_fails_nothing() -> None:
    record = RequestRecord(prompt=PROMPT, block_ids=[[1, 2, 3, 4]], saved_end=128)
    record.admit()
    record.queue_load(load_spec(), None)
    record.hand_over()
    record.lose_blocks()
    assert (record.phase, record.transfer, record.block_ids) == (RequestPhase.PREEMPTED, None, [])
    assert record.saved_end is None, "readmitted, its next save starts from the store's hit"
    record.finish_load(64, {})
    assert (record.phase, record.loaded_tokens, record.load_failed_tokens) == (RequestPhase.PREEMPTED, 0, 0)
    record.admit()
    assert record.phase is RequestPhase.RUNNING


def test_a_request_finished_in_its_blend_step_keeps_its_answer_until_the_report() -> None:
    record = RequestRecord(prompt=PROMPT, admitted=Probe(prefix_tokens=16, first_disk_token=None))
    record.admit()
    record.queue_blend(blend_spec())
    record.hand_over()
    assert (record.phase, record.blended, record.planned_blend) == (RequestPhase.BLENDING, True, blend_spec())
    answer = record.transfer_params()
    record.finish_awaiting_blend(answer)
    assert RequestPhase.is_finished(record.phase) and record.answer is answer
    outcome = BlendOutcome(exact_tokens=16, blend_tokens=24, gap_tokens=8, recomputed_tokens=14, skipped_disk_tokens=0)
    record.finish_blend(blend_spec(), outcome)
    assert record.phase is RequestPhase.FINISHED_AWAITING_BLEND and record.planned_blend is None
    report = record.transfer_params()["kvstore"]
    assert isinstance(report, dict)
    assert report["loaded_tokens"] == 48 and report["blend"]["reused_tokens"] == 34  # type: ignore[index]


@pytest.mark.parametrize("phase", [RequestPhase.LOADING, RequestPhase.BLENDING, RequestPhase.RUNNING])
def test_admission_does_not_move_a_request_that_is_past_it(phase: RequestPhase) -> None:
    record = RequestRecord(prompt=PROMPT, phase=phase)
    record.admit()
    assert record.phase is phase


def test_a_hit_ending_in_an_exact_slice_is_saved_from_the_slice_start() -> None:
    """A prefix hit that ends in rows of a stored chunk going on otherwise (an exact slice): the prompt's own chunk
    there is not in the store, so its save starts where the slice does."""
    key = PrefixKey(b"k" * 16)
    whole = Segment(start=0, num_tokens=32, key=key, source_start=0, exact=True, tier=TierName.CPU)
    sliced = Segment(start=32, num_tokens=20, key=key, source_start=32, exact=True, tier=TierName.CPU,
                     chunk_tokens=40)  # fmt: skip
    record = RequestRecord(prompt=PROMPT, admitted=Probe(prefix_tokens=52, first_disk_token=None,
                                                         segments=(whole, sliced)))  # fmt: skip
    assert (record.store_prefix_tokens, record.store_held_tokens) == (52, 32)
    plain = Probe(prefix_tokens=32, first_disk_token=None, segments=(whole,))
    assert plain.held_tokens == 32 and RequestRecord(prompt=PROMPT).store_held_tokens == 0
