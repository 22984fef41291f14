"""Blending: find stored chunks inside new prompts by content and reuse their KV at new positions."""

from __future__ import annotations

from kvstore.blend.index import Alias, FingerprintIndex, Match, RegistrationResult
from kvstore.blend.rope import PlacedRange, RopeRotator, Rotation, inverse_frequencies, rotate_keys, token_deltas

__all__ = [
    "Alias",
    "FingerprintIndex",
    "Match",
    "PlacedRange",
    "RegistrationResult",
    "RopeRotator",
    "Rotation",
    "inverse_frequencies",
    "rotate_keys",
    "token_deltas",
]
