"""The random-init models' names and their check, without the models themselves (``kvstore.models.random_init``).

Why apart: ``kvstore.models.random_init`` imports torch; ``kvstore bench multi-doc-qa --random-init NAME`` lists and
checks the names before torch is imported. ``kvstore.models.random_init`` takes its names and check from here;
``tests/models/test_random_init.py`` checks them against its configurations.
"""

from __future__ import annotations

from kvstore.errors import ConfigError

__all__ = ["RANDOM_INIT_PRESETS", "check_random_init_preset"]

RANDOM_INIT_PRESETS = ("llama3.1-8b", "tiny-llama")
"""Names ``random_init_model`` accepts, in the order help texts list them."""


def check_random_init_preset(preset: str) -> None:
    """Raise ``ConfigError`` unless ``preset`` is one of ``RANDOM_INIT_PRESETS``."""
    if preset not in RANDOM_INIT_PRESETS:
        raise ConfigError(f"unknown random-init model {preset!r}; use one of {', '.join(RANDOM_INIT_PRESETS)}")
