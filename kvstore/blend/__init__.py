"""Blending: find stored chunks inside new prompts by content and reuse their KV at new positions."""

from __future__ import annotations

from kvstore.blend.blender import BlendOutput, LayerwiseBlender, PrefillMode, PrefillTimings
from kvstore.blend.index import Alias, FingerprintIndex, Match, RegistrationResult
from kvstore.blend.layerwise import BlendConfig, BlendPlanSummary
from kvstore.blend.rope import PlacedRange, RopeRotator, Rotation, inverse_frequencies, rotate_keys, token_deltas
from kvstore.blend.rope_gate import PositionShift, RopeGateReport, check_rope_gate, gate_tolerance, require_rope_gate
from kvstore.blend.selection import DeviationMetric

__all__ = [
    "Alias",
    "BlendConfig",
    "BlendOutput",
    "BlendPlanSummary",
    "DeviationMetric",
    "FingerprintIndex",
    "LayerwiseBlender",
    "Match",
    "PlacedRange",
    "PositionShift",
    "PrefillMode",
    "PrefillTimings",
    "RegistrationResult",
    "RopeGateReport",
    "RopeRotator",
    "Rotation",
    "check_rope_gate",
    "gate_tolerance",
    "inverse_frequencies",
    "require_rope_gate",
    "rotate_keys",
    "token_deltas",
]
