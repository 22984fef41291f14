"""``kvstore bench vllm``'s parts that run without vLLM: its prompts, its engine specs, its refusals.

The benchmark itself runs real vLLM engines (``.venv-vllm/bin/kvstore bench vllm``); its engine driver is exercised
by every test in tests/vllm.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.bench.miss_tally import MissTally
from kvstore.bench.pd_proxy import PrefillDecodeProxy
from kvstore.bench.vllm_engine import EngineSpec, RequestResult
from kvstore.bench.vllm_ttft import (
    VllmBenchOptions,
    VllmBenchRow,
    prose_prompts,
    run_driver,
    run_vllm_benchmark,
    store_killed_session,
    with_connector_time,
)
from kvstore.cli.main import main
from kvstore.errors import ConfigError
from tests.server.conftest import start_server


def words(text: str) -> list[int]:
    return [len(word) for word in text.split()]


def test_prose_prompts_are_disjoint_windows_of_the_asked_length() -> None:
    prompts = prose_prompts(words, 4, 2000)
    assert [len(prompt) for prompt in prompts] == [2000] * 4
    whole = prose_prompts(words, 1, 8000)[0]
    assert [token for prompt in prompts for token in prompt] == whole


def test_prose_prompts_refuse_more_than_the_docstrings_hold() -> None:
    with pytest.raises(ConfigError, match="tokens of docstrings"):
        prose_prompts(words, 1000, 100_000)


@given(
    prompts=st.lists(st.lists(st.integers(0, 50_000), min_size=1, max_size=20), min_size=1, max_size=4),
    max_tokens=st.integers(1, 64),
    wait=st.none() | st.floats(0.1, 100),
    kills=st.dictionaries(st.integers(0, 3).map(str), st.lists(st.lists(st.text(min_size=1), min_size=1), max_size=2)),
)
def test_engine_specs_and_results_survive_json(prompts, max_tokens, wait, kills) -> None:
    spec = EngineSpec(
        model_dir=Path("/models/m"),
        prompts=[tuple(prompt) for prompt in prompts],
        max_tokens=max_tokens,
        kv_transfer_config={"kv_connector": "KVStoreConnector", "kv_connector_extra_config": {"kvstore.url": "x"}},
        wait_until_stored_s=wait,
        commands_before={index: [tuple(command) for command in commands] for index, commands in kills.items()},
    )
    again = EngineSpec.from_json(spec.to_json())
    assert again.to_json() == spec.to_json()
    assert [list(prompt) for prompt in again.prompts] == prompts
    result = RequestResult(token_ids=tuple(prompts[0]), num_cached_tokens=128, ttft_s=0.5)
    assert RequestResult.from_json(result.to_json()) == result and result.kvstore_loaded_tokens is None
    report = {"kvstore": {"loaded_tokens": 128, "load_failed_tokens": 0}}
    loaded = RequestResult(token_ids=(1,), num_cached_tokens=128, ttft_s=0.5, kv_transfer_params=report)
    assert RequestResult.from_json(loaded.to_json()) == loaded and loaded.kvstore_loaded_tokens == 128


def test_an_engine_spec_refuses_empty_prompts_and_no_tokens() -> None:
    with pytest.raises(ValueError, match="no empty prompt"):
        EngineSpec(model_dir=Path("m"), prompts=[[1], []], max_tokens=1)
    with pytest.raises(ValueError, match="at least one new token"):
        EngineSpec(model_dir=Path("m"), prompts=[[1]], max_tokens=0)


def test_options_and_rows() -> None:
    with pytest.raises(ConfigError, match="--prompt-tokens 10"):
        VllmBenchOptions(model_dir=Path("m"), prompt_tokens=10)
    with pytest.raises(ConfigError, match="--prompts 0"):
        VllmBenchOptions(model_dir=Path("m"), num_prompts=0)
    row = VllmBenchRow(
        mode="kvstore_cpu_hit",
        prompt_tokens=8000,
        ttft_ms_p50=812.345,
        speedup_vs_cold=12.3456,
        num_cached_tokens_p50=7936,
        kvstore_loaded_tokens_p50=7680,
        ttft_ms_samples=(800.01, 812.345),
        connector_ms_p50=310.456,
        connector_share_p50=0.3821734,
        misses=MissTally(looked_up_tokens=16000, missed_tokens=64, reasons={"block_boundary": 64}),
    )
    assert row.misses.describe() == "64/16,000: block_boundary 64"
    assert row.to_json_dict() == {
        "mode": "kvstore_cpu_hit",
        "prompt_tokens": 8000,
        "ttft_ms_p50": 812.3,
        "speedup_vs_cold": 12.346,
        "num_cached_tokens_p50": 7936,
        "kvstore_loaded_tokens_p50": 7680,
        "ttft_ms_samples": [800.0, 812.3],
        "connector_ms_p50": 310.5,
        "connector_share_p50": 0.38217,
        "looked_up_tokens": 16000,
        "missed_tokens": 64,
        "miss_reasons": {"block_boundary": 64},
        "miss_reasons_share": 1.0,
    }


def test_the_cli_refuses_a_model_dir_without_a_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", "vllm", "--model", str(tmp_path)])
    assert exited.value.code == 1
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "no config.json" in error


def test_connector_time_goes_to_the_request_whose_generate_call_it_fell_in(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    steps = [("scheduler", 100.5, 0.001), ("worker", 101.0, 0.25), ("worker", 150.0, 0.5), ("worker", 205.0, 0.125)]
    trace.write_text("".join(json.dumps({"side": s, "t": t, "seconds": x}) + "\n" for s, t, x in steps))
    results = [
        RequestResult(token_ids=(1,), num_cached_tokens=0, ttft_s=1.0, started_at=100.0, finished_at=149.0),
        RequestResult(token_ids=(1,), num_cached_tokens=0, ttft_s=1.0, started_at=149.5, finished_at=200.0),
    ]
    first, second = with_connector_time(results, trace)
    assert first.connector_ms == pytest.approx(251.0) and second.connector_ms == pytest.approx(500.0)
    assert with_connector_time(results, tmp_path / "no-trace.jsonl") == results  # no connector: no figure


def test_the_benchmark_needs_a_warm_up_and_a_measured_prompt() -> None:
    with pytest.raises(ConfigError, match="warm-up prompt and at least one measured"):
        run_vllm_benchmark(VllmBenchOptions(model_dir=Path("m")), [[1] * 300])


def test_the_store_killed_session_kills_the_server_then_waits_for_a_new_one(tmp_path: Path) -> None:
    """The session behind the store-killed rows: its commands kill a real ``kvstore serve`` on the data dir, and
    return once a new server there answers."""
    data_dir = tmp_path / "data"
    spec = store_killed_session([[1, 2, 3], [4, 5, 6], [7, 8, 9]], data_dir, retry_s=0.1)
    assert spec.prompts == ((1, 2, 3), (4, 5, 6), (5, 6, 4), (4, 5, 6), (4, 5, 6), (7, 8, 9), (8, 9, 7), (7, 8, 9),
                            (7, 8, 9))  # fmt: skip
    assert sorted(spec.commands_before, key=int) == ["1", "3", "4", "5", "7", "8"]
    first = start_server(data_dir)
    try:
        subprocess.run(spec.commands_before["1"][0], check=True, timeout=60)
        assert first.process.wait(30) == -signal.SIGKILL
        second = start_server(data_dir)
        try:
            subprocess.run(spec.commands_before["4"][0], check=True, timeout=60)
            assert second.process.poll() is None
        finally:
            second.stop()
            assert second.process.stdout is not None
            second.process.stdout.close()
    finally:
        first.kill()
        assert first.process.stdout is not None
        first.process.stdout.close()


def test_the_split_proxy_sends_one_token_of_prefill_then_the_decode_and_times_both_for_its_client() -> None:
    calls: list[tuple[str, int]] = []

    def engine(name: str, started_at: float, ttft_s: float) -> Callable[[Sequence[int], int], RequestResult]:
        def generate(prompt: Sequence[int], max_tokens: int) -> RequestResult:
            calls.append((name, max_tokens))
            return RequestResult(token_ids=(1,) * max_tokens, num_cached_tokens=0, ttft_s=ttft_s, started_at=started_at)

        return generate

    proxy = PrefillDecodeProxy(prefill=engine("prefill", 100.0, 2.0), decode=engine("decode", 102.5, 0.25))
    routed = proxy.complete([7] * 300, 16)
    assert calls == [("prefill", 1), ("decode", 16)]
    assert len(routed.decode.token_ids) == 16
    assert routed.ttft_s == pytest.approx(2.75)  # prefill call to the decode engine's first token


def test_a_driver_past_its_timeout_is_stopped_with_the_processes_it_started(tmp_path: Path) -> None:
    pid_file = tmp_path / "engine.pid"
    ok = [sys.executable, "-c", "import sys; print(sys.stdin.read().upper())"]
    assert run_driver(ok, "spec", 1, timeout_s=30) == ["SPEC"]
    engine = (
        "import subprocess, pathlib; engine = subprocess.Popen(['sleep', '60']); "
        f"pathlib.Path({str(pid_file)!r}).write_text(str(engine.pid)); engine.wait()"
    )
    with pytest.raises(ConfigError, match="ran past 2 s"):
        run_driver([sys.executable, "-c", engine], "spec", 1, timeout_s=2)
    orphan = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while Path(f"/proc/{orphan}").exists() and "Z" not in Path(f"/proc/{orphan}/stat").read_text().split()[2:3]:
        assert time.monotonic() < deadline, "the driver's child outlived it"
        time.sleep(0.05)
