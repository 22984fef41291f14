"""How the ``kvstore`` command writes sizes and counts: one rule everywhere, so the banner, ``inspect`` and
``evict`` can be compared at a glance (not GiB in the banner and MiB in ``inspect``, nor "1 chunks").

Sizes use binary units, the largest in which the value is at least 1 (``512.00 MiB``, ``4.00 GiB``), with two
decimals: the units the size flags take (``--cpu-size 4GiB``). JSON output keeps exact byte counts.
"""

from __future__ import annotations

__all__ = ["count_text", "size_text"]

_BINARY_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def size_text(num_bytes: int) -> str:
    """``num_bytes`` for a person: ``812 B``, ``1.50 KiB``, ``512.00 MiB``, ``4.00 GiB``."""
    if abs(num_bytes) < 1024:
        return f"{num_bytes} B"
    value = num_bytes / 1024
    unit_idx = 0
    while abs(value) >= 1024 and unit_idx < len(_BINARY_UNITS) - 1:
        value /= 1024
        unit_idx += 1
    return f"{value:,.2f} {_BINARY_UNITS[unit_idx]}"


def count_text(count: int, noun: str, plural: str | None = None) -> str:
    """``count`` and its noun, singular for exactly one: ``1 chunk``, ``0 chunks``, ``1,024 chunks``."""
    return f"{count:,} {noun if count == 1 else (plural or noun + 's')}"
