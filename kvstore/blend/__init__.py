"""Blending: find stored chunks inside new prompts by content and reuse their KV at new positions."""

from __future__ import annotations

from kvstore.blend.index import Alias, FingerprintIndex, Match, RegistrationResult

__all__ = ["Alias", "FingerprintIndex", "Match", "RegistrationResult"]
