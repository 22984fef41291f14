"""Start coverage in this process when it first imports the kvstore code the vLLM suite measures, not when it starts.

tests/vllm/untraced_parent.py puts this directory on the ``PYTHONPATH`` of an engine's processes (vLLM's engine core
and workers, spawned: fresh interpreters, which import ``sitecustomize`` at start) with coverage's variables renamed
(``TRACED_FROM_KVSTORE_<name>``, which coverage's own start-up does not read). Traced from their start, those
processes trace vLLM's and torch's imports too: about 6 s of one core each, two processes an engine, for no line the
suite measures (``kvstore/connectors`` and ``kvstore/blend/vllm``: ``tests/vllm/conftest.py``). A spawned process
imports the driver's module first (``kvstore.bench``: multiprocessing's start-up), then vLLM, then kvstore's vLLM
plugin and connector, so starting coverage at the first import of either measured package measures every line of
them those processes run, module bodies included.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

RENAMED_PREFIX = "TRACED_FROM_KVSTORE_"
MEASURED = ("kvstore.connectors", "kvstore.blend.vllm")
_MEASURED_SUBMODULES = tuple(f"{package}." for package in MEASURED)  # asked of every import until the first match


class _StartCoverageOnKvstore:
    """A ``sys.meta_path`` finder that finds nothing: on the first import of a measured package it puts coverage's
    variables back (so this process's own children are traced from their start, as before), starts coverage and
    leaves."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname in MEASURED or fullname.startswith(_MEASURED_SUBMODULES):
            sys.meta_path.remove(self)
            for name in [name for name in os.environ if name.startswith(RENAMED_PREFIX)]:
                os.environ[name.removeprefix(RENAMED_PREFIX)] = os.environ.pop(name)
            import coverage

            coverage.process_startup(slug="kvstore")
        return None


if any(name.startswith(RENAMED_PREFIX) for name in os.environ):
    sys.meta_path.insert(0, _StartCoverageOnKvstore())
