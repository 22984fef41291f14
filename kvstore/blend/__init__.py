"""Blending, the engine side: reuse the store's cached KV at new positions in a prompt (CacheBlend).

- ``blender``, ``layerwise``, ``llama_layers``: one blended prefill, layer by layer, of a Llama-family model;
- ``rope``, ``rope_gate``: re-rotating cached K to new positions, and the per-model proof that this is exact;
- ``config``: ``BlendConfig`` and its choices (selection policy, deviation, attention kernel, disk policy), torch-free
  so that a command line's blend settings are checked before torch is imported;
- ``selection``, ``recurring_context``, ``query_attention``: which tokens are recomputed, and their attention;
- ``kv_loading``, ``load_cost``, ``stage_clock``: loading a plan's KV while the model computes, the disk-or-recompute
  choice, and timing the stages.
- ``layer_stack``: what the pass needs from a model (``LlamaStack`` for Hugging Face models);
- ``vllm``: the same pass inside vLLM, on the modules of the model a vLLM worker loaded (kvstore's vLLM plugin).

Finding cached chunks by content is the store's job (``kvstore.content``, below the store).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from kvstore.blend.blender import BlendOutput, LayerwiseBlender, PrefillMode, PrefillTimings
    from kvstore.blend.config import BlendConfig, DeviationMetric, SelectionPolicy
    from kvstore.blend.layerwise import BlendPlanSummary
    from kvstore.blend.rope import (
        PlacedRange,
        RopeRotator,
        Rotation,
        inverse_frequencies,
        rotate_keys,
        token_deltas,
    )
    from kvstore.blend.rope_gate import (
        PositionShift,
        RopeGateReport,
        check_rope_gate,
        gate_tolerance,
        require_rope_gate,
    )

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "kvstore.blend.blender": ("BlendOutput", "LayerwiseBlender", "PrefillMode", "PrefillTimings"),
        "kvstore.blend.config": ("BlendConfig", "DeviationMetric", "SelectionPolicy"),
        "kvstore.blend.layerwise": ("BlendPlanSummary",),
        "kvstore.blend.rope": (
            "PlacedRange",
            "RopeRotator",
            "Rotation",
            "inverse_frequencies",
            "rotate_keys",
            "token_deltas",
        ),
        "kvstore.blend.rope_gate": (
            "PositionShift",
            "RopeGateReport",
            "check_rope_gate",
            "gate_tolerance",
            "require_rope_gate",
        ),
    },
)
__all__ = [
    "BlendConfig",
    "BlendOutput",
    "BlendPlanSummary",
    "DeviationMetric",
    "LayerwiseBlender",
    "PlacedRange",
    "PositionShift",
    "PrefillMode",
    "PrefillTimings",
    "RopeGateReport",
    "RopeRotator",
    "Rotation",
    "SelectionPolicy",
    "check_rope_gate",
    "gate_tolerance",
    "inverse_frequencies",
    "require_rope_gate",
    "rotate_keys",
    "token_deltas",
]
