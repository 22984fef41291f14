"""Blending, the engine side: reuse the store's cached KV at new positions in a prompt (CacheBlend).

- ``blender``: ``LayerwiseBlender``, a blended prefill of a Llama-family model;
- ``layerwise``: one blended prefill, layer by layer: reuse cached KV, recompute the tokens that need it;
- ``llama_layers``: a Llama-family Hugging Face model's forward pass, one decoder layer at a time;
- ``layer_stack``: ``LayerStack``, what the pass needs from a model (``LlamaStack`` for Hugging Face models);
- ``rope``: re-rotating cached K from the positions it was computed at to those it is reused at;
- ``rope_gate``: the per-model proof, with the model's own code, that this re-rotation is exact;
- ``config``: ``BlendConfig`` and its choices, torch-free so that a command line's blend settings are checked
  before torch is imported;
- ``selection``: which tokens are recomputed (the most deviating cached ones, and every uncached one);
- ``recurring_context``: cached tokens whose context recurs earlier in the prompt;
- ``query_attention``: attention of a subset of the tokens over the whole prompt, causal by absolute position;
- ``pass_loads``: where a pass's cached KV comes from (``PlanSource``) and the retrieve it starts;
- ``kv_loading``: loading a plan's KV layer by layer on a worker thread while the model computes;
- ``ranks``: what the ranks of a tensor-parallel engine agree on to run one pass together;
- ``load_cost``: waiting for the disk or recomputing, whichever is faster for disk-only chunks;
- ``stage_clock``: timing the stages of a prefill truthfully on the CPU and on a GPU;
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
