"""``HookClock``: the engine thread's time inside the connector's hooks, per step, and its optional trace."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest

from kvstore.connectors.hook_clock import TRACE_ENV, HookClock


def test_a_step_adds_up_its_hooks_and_the_next_starts_at_zero(tmp_path: Path) -> None:
    clock = HookClock("worker", environ={})
    for _ in range(3):
        with clock:
            time.sleep(0.01)
    time.sleep(0.05)  # outside the hooks: not counted
    seconds = clock.end_step()
    assert 0.03 <= seconds < 0.05
    assert clock.end_step() == 0.0


def test_a_hook_that_raises_is_still_counted() -> None:
    clock = HookClock("scheduler", environ={})
    with pytest.raises(RuntimeError), clock:
        time.sleep(0.01)
        raise RuntimeError("hook failed")
    assert clock.end_step() >= 0.01


def test_steps_are_traced_as_json_lines_when_asked(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    clock = HookClock("worker", environ={TRACE_ENV: str(trace)})
    before = time.time()
    for _ in range(2):
        with clock:
            time.sleep(0.005)
        clock.end_step()
    clock.end_step()  # a step without hook time writes nothing
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [line["side"] for line in lines] == ["worker", "worker"]
    assert all(line["seconds"] >= 0.005 and before <= line["t"] <= time.time() for line in lines)


def test_an_unwritable_trace_is_reported_once_and_dropped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clock = HookClock("worker", environ={TRACE_ENV: str(tmp_path / "missing-dir" / "trace.jsonl")})
    with caplog.at_level(logging.WARNING, logger="kvstore.connectors.hook_clock"):
        for _ in range(3):
            with clock:
                pass
            assert clock.end_step() > 0
    assert len(caplog.records) == 1 and "tracing stops" in caplog.records[0].getMessage()
