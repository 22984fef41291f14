"""The vLLM virtualenv's numba keeps its compiled kernels apart from the main virtualenv's.

Both virtualenvs import kvstore from the checkout, and their numba versions differ (vLLM pins its own). numba keeps one
cache index a kernel beside the source, which a different numba version discards and overwrites, so each virtualenv
recompiled the content index's kernels after the other had run: about 10 s of a core in the embedded server, beside
the engine whose requests were being timed. The Makefile writes a ``.pth`` file that points this virtualenv's numba
cache inside it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numba.core.config


def test_numba_caches_kernels_inside_this_virtualenv() -> None:
    cache_dir = Path(numba.core.config.CACHE_DIR)
    assert numba.core.config.CACHE_DIR, "NUMBA_CACHE_DIR is not set: kernels are cached beside the shared source"
    assert cache_dir.resolve().is_relative_to(Path(sys.prefix).resolve())
