"""kvstore's vLLM plugin (entry point ``vllm.general_plugins: kvstore_blend``): it registers the blend engine.

vLLM calls ``register()`` early in every one of its processes (the API server, the engine core, each worker),
for every user with kvstore installed, blending or not, and without a guard: an exception here would stop vLLM.
So it only puts a factory into the blend hook (``hook``) and imports nothing heavy (no torch, no vLLM model code);
the engine and its modules load when a worker whose connector has ``kvstore.blend`` on builds it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.blend.vllm.hook import register_blend_engine

if TYPE_CHECKING:
    from kvstore.blend.vllm.hook import BlendEngine, BlendEngineContext

__all__ = ["register"]


def register() -> None:
    """Make kvstore's vLLM blend engine available to the connector in this process (idempotent)."""
    register_blend_engine(_build_engine)


def _build_engine(context: BlendEngineContext) -> BlendEngine:
    from kvstore.blend.vllm.engine import VllmBlendEngine

    return VllmBlendEngine(context)
