"""``kvstore bench vllm --kv-cache-dtype``: the option reaches every session's engine, and a bad value or a mode that
does not take it is one line (the benchmark's runs themselves need vLLM: tests/vllm)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.bench.vllm_engine import EngineSpec
from kvstore.bench.vllm_ttft import VllmBenchOptions
from kvstore.cli.main import main
from kvstore.errors import ConfigError


def test_the_kv_cache_dtype_travels_in_the_engine_spec() -> None:
    spec = EngineSpec(model_dir=Path("m"), prompts=[[1, 2]], max_tokens=1, kv_cache_dtype="fp8")
    assert EngineSpec.from_json(spec.to_json()).kv_cache_dtype == "fp8"
    assert EngineSpec(model_dir=Path("m"), prompts=[[1]], max_tokens=1).kv_cache_dtype == "auto"
    assert VllmBenchOptions(model_dir=Path("m"), kv_cache_dtype="fp8_e5m2").kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(ConfigError, match="--kv-cache-dtype fp4"):
        VllmBenchOptions(model_dir=Path("m"), kv_cache_dtype="fp4")


@pytest.mark.parametrize("mode", ["--blend", "--serve"])
def test_the_cli_refuses_the_option_outside_the_default_mode(
    tmp_path: Path, mode: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", "vllm", "--model", str(tmp_path), "--kv-cache-dtype", "fp8", mode])
    assert exited.value.code == 1
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "--kv-cache-dtype fp8 is for the default mode" in error
