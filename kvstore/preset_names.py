"""The layout presets' names and the smallest one's size, without the layouts themselves (``kvstore.presets``).

Why apart: ``kvstore.presets`` builds ``KVLayout`` s, and ``kvstore.layout`` imports torch; the CLI refuses an
unknown ``--layout`` name, and a tier too small for any plausible model, before torch is imported.
``kvstore.presets`` takes its names from here; ``tests/server/test_settings_light.py`` checks the smallest preset's size
against its layout.
"""

from __future__ import annotations

from kvstore.errors import ConfigError

__all__ = ["PRESET_NAMES", "SMALLEST_PRESET", "SMALLEST_PRESET_ELEMENTS_PER_TOKEN", "check_preset_name"]

PRESET_NAMES = ("smollm2-135m", "llama3.1-8b")
"""The names ``kvstore.presets.preset_layout`` knows, in the order help texts list them."""

SMALLEST_PRESET = "smollm2-135m"
"""The preset with the least KV per token: the smallest model a server without ``--layout`` plausibly serves."""

SMALLEST_PRESET_ELEMENTS_PER_TOKEN = 30 * 2 * 3 * 64
"""KV elements per token of ``SMALLEST_PRESET``: 30 layers x (K, V) x 3 KV heads x 64 dimensions (bytes, at one
byte an element: fp8)."""


def check_preset_name(name: str) -> None:
    """Raise ``ConfigError`` unless ``name`` is a layout preset (the one message, for ``preset_layout`` and the CLI)."""
    if name not in PRESET_NAMES:
        raise ConfigError(f"unknown layout preset {name!r}; use one of {', '.join(PRESET_NAMES)}")
