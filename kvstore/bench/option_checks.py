"""Checks the benchmarks' option dataclasses share, importing nothing heavy.

Why a module of its own: ``kvstore bench ...`` refuses a bad option before torch, numba or LMDB is imported, so the
option dataclasses (``kvstore.bench.*_options``) may import only light modules; ``kvstore.presets`` builds
``KVLayout`` s (torch), so a preset name is checked here against ``kvstore.preset_names`` instead.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvstore.errors import ConfigError
from kvstore.preset_names import check_preset_name

__all__ = ["check_positive", "check_preset_names"]


def check_preset_names(names: Iterable[str]) -> None:
    """Raise ``ConfigError`` on the first name that is not a layout preset (as ``preset_layout`` would, later)."""
    for name in names:
        check_preset_name(name)


def check_positive(benchmark: str, options: object, names: Iterable[str]) -> None:
    """Raise ``ConfigError`` naming the first of ``options``' fields ``names`` that is not above 0."""
    for name in names:
        value = getattr(options, name)
        if value <= 0:
            raise ConfigError(f"{benchmark} benchmark {name}={value} must be positive")
