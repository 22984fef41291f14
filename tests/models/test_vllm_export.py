"""The SmolLM2 export for vLLM: what vLLM's loader reads is there, the weights are the converted copy's, and the
directory appears whole or not at all. (A real vLLM engine loading it is tests/vllm/models/test_engine_baseline.py.)"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import safetensors.torch
import torch

from kvstore.errors import ConfigError, StorageError
from kvstore.models import built_once, default_model_cache_dir, load_local_model, load_smollm2, vllm_export
from kvstore.models.vllm_export import export_smollm2_for_vllm


def test_the_real_export_holds_what_vllm_reads_and_computes_what_the_copy_computes() -> None:
    cache_dir = default_model_cache_dir(os.environ)
    exported = export_smollm2_for_vllm(cache_dir)
    reference = load_smollm2(cache_dir=cache_dir)
    assert exported.name == f"{reference.source.name}-vllm" and exported.parent == reference.source.parent

    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "float32"
    with safetensors.safe_open(str(exported / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (exported / name).read_bytes() == (reference.source / name).read_bytes()

    loaded = load_local_model(exported)
    prompt = reference.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        assert torch.equal(loaded.model(input_ids=prompt).logits, reference.model(input_ids=prompt).logits)


def fake_converted_copy(directory: Path, *, tensor_names: tuple[str, ...] = ("lm_head.weight",),
                        tied: bool = True) -> Path:
    """A converted copy in miniature: the config keys the export reads, a 4x2 tied matrix, one tokenizer file."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "llama", "tie_word_embeddings": tied}))
    matrix = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    tensors = {name: matrix.clone() for name in tensor_names}
    tensors["model.norm.weight"] = torch.ones(2)
    safetensors.torch.save_file(tensors, str(directory / "model.safetensors"))
    (directory / "tokenizer.json").write_text("{}")
    return directory


@pytest.fixture
def copy_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The export's source replaced by a fake converted copy under ``tmp_path / "models"``."""
    copy = fake_converted_copy(tmp_path / "models" / "SmolLM2-135M-Instruct-0123-transformers-5.0.0")
    monkeypatch.setattr(vllm_export, "_converted_copy", lambda gguf, cache_dir: copy)
    return copy


def test_the_tied_matrix_is_stored_once_under_the_embedding_name(copy_dir: Path, tmp_path: Path) -> None:
    exported = export_smollm2_for_vllm(tmp_path)
    assert exported == copy_dir.with_name(copy_dir.name + "-vllm")
    weights = safetensors.torch.load_file(str(exported / "model.safetensors"))
    assert sorted(weights) == ["model.embed_tokens.weight", "model.norm.weight"]
    assert torch.equal(weights["model.embed_tokens.weight"], torch.arange(8, dtype=torch.float32).reshape(4, 2))
    assert (exported / "tokenizer.json").read_text() == "{}"
    assert sorted(path.name for path in tmp_path.joinpath("models").iterdir()) == [copy_dir.name, exported.name]


def test_a_copy_that_already_names_the_embedding_keeps_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    copy = fake_converted_copy(tmp_path / "models" / "copy", tensor_names=("model.embed_tokens.weight",
                                                                           "lm_head.weight"))
    monkeypatch.setattr(vllm_export, "_converted_copy", lambda gguf, cache_dir: copy)
    weights = safetensors.torch.load_file(str(export_smollm2_for_vllm(tmp_path) / "model.safetensors"))
    assert sorted(weights) == ["model.embed_tokens.weight", "model.norm.weight"]


def test_a_second_call_reuses_the_export(copy_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    first = export_smollm2_for_vllm(tmp_path)
    with caplog.at_level(logging.INFO, logger="kvstore.models.vllm_export"):
        assert export_smollm2_for_vllm(tmp_path) == first
    assert caplog.records == []


def test_another_process_exporting_first_is_used(copy_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    def rename_after_the_other_process(source: Path, target: Path) -> None:
        Path(target).mkdir()
        (Path(target) / "config.json").write_text("{}")
        raise OSError(39, "Directory not empty")

    monkeypatch.setattr(built_once.os, "rename", rename_after_the_other_process)
    with caplog.at_level(logging.INFO, logger="kvstore.models.built_once"):
        exported = export_smollm2_for_vllm(tmp_path)
    assert (exported / "config.json").read_text() == "{}"
    assert any("another process made the vLLM export" in record.getMessage() for record in caplog.records)
    assert sorted(path.name for path in exported.parent.iterdir()) == [copy_dir.name, exported.name]


def test_a_failed_write_leaves_nothing_and_says_what_to_do(copy_dir: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    def full_disk(source: Path, target: Path) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(built_once.os, "rename", full_disk)
    with pytest.raises(StorageError, match=r"cannot write the vLLM export to .*-vllm .*No space left.*free space"):
        export_smollm2_for_vllm(tmp_path)
    assert [path.name for path in copy_dir.parent.iterdir()] == [copy_dir.name]


def test_an_unwritable_cache_dir_raises_a_storage_error(copy_dir: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    def read_only(**kwargs: object) -> str:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(built_once.tempfile, "mkdtemp", read_only)
    with pytest.raises(StorageError, match=r"cannot create a directory in .* for the vLLM export .*another cache_dir"):
        export_smollm2_for_vllm(tmp_path)


@pytest.mark.parametrize(
    ("tensor_names", "tied", "message"),
    [
        (("lm_head.weight",), False, "tie_word_embeddings=False; the vLLM export expects"),
        (("model.layers.0.mlp.up_proj.weight",), True, "holds neither model.embed_tokens.weight nor lm_head.weight"),
    ],
)
def test_a_copy_the_export_does_not_know_is_refused(
    tensor_names: tuple[str, ...], tied: bool, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = fake_converted_copy(tmp_path / "models" / "copy", tensor_names=tensor_names, tied=tied)
    monkeypatch.setattr(vllm_export, "_converted_copy", lambda gguf, cache_dir: copy)
    with pytest.raises(ConfigError, match=message):
        export_smollm2_for_vllm(tmp_path)
    assert [path.name for path in copy.parent.iterdir()] == ["copy"]
