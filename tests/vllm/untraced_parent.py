"""Run a Python script untraced while the processes it starts are traced by coverage from their first kvstore import.

Coverage starts in every Python process whose environment names its configuration (``COVERAGE_PROCESS_CONFIG``,
``COVERAGE_PROCESS_START``: tests/vllm/coverage.toml's ``patch = subprocess``). An engine driver runs no connector
code itself: the connector runs in the engine-core and worker processes vLLM spawns. Yet traced, the driver's own
import of vLLM and its share of every request cost about as much CPU again as untraced, and so do the engine
processes' own imports of vLLM and torch. So the driver starts with those variables renamed
(``UNTRACED_PARENT_<name>``, which no coverage start-up reads), and this wrapper hands them to the script's children
renamed once more (``TRACED_FROM_KVSTORE_<name>``) with ``traced_from_kvstore/`` on their ``PYTHONPATH``: its
``sitecustomize`` starts coverage in each child when the child first imports kvstore.

    python -P tests/vllm/untraced_parent.py SCRIPT [ARGS...]
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

RENAMED_PREFIX = "UNTRACED_PARENT_"
TRACED_FROM_KVSTORE = Path(__file__).with_name("traced_from_kvstore")


def main() -> None:
    child_prefix = runpy.run_path(str(TRACED_FROM_KVSTORE / "sitecustomize.py"))["RENAMED_PREFIX"]
    for name in [name for name in os.environ if name.startswith(RENAMED_PREFIX)]:
        os.environ[child_prefix + name.removeprefix(RENAMED_PREFIX)] = os.environ.pop(name)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TRACED_FROM_KVSTORE), os.environ.get("PYTHONPATH")]))
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
