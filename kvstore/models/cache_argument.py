"""The keyword a transformers causal LM takes its KV cache under.

transformers 5.24 renamed ``past_key_values`` to ``cache`` (the forward's argument and its output); older releases
accept unknown keywords silently, so a cache passed under the new name to an older model is dropped and decoding
goes on without context. The repository's dev pins are 5.24, but ``.venv-vllm`` runs vLLM's own pin (5.19), and the
vLLM tests run the standalone blender there too; so the name is read from the model's signature.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["cache_argument"]


def cache_argument(model: Any, cache: Any) -> dict[str, Any]:
    """``{name: cache}`` for ``model(..., **cache_argument(model, cache))``."""
    parameters = inspect.signature(model.forward).parameters
    return {"cache" if "cache" in parameters else "past_key_values": cache}
