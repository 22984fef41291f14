"""Pausing Python's cyclic garbage collector around bulk work that allocates many objects and frees no cycles.

Building a million index entries at open, or decoding a hundred thousand events, crosses the collector's allocation
threshold again and again, and each crossing walks every tracked object: in a process that holds a large heap (torch,
a mirror of a store) that costs several times the work itself (measured: docs/design-notes.md#store,
#tiers-disk-opening). None of that work makes cyclic garbage; reference counting frees it as usual while paused.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collector_paused"]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The collector off for the block, then as it was (nested pauses restore the outer state)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
