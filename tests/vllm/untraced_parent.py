"""Run a Python script untraced while the processes it starts are traced by coverage.

Coverage starts in every Python process whose environment names its configuration (``COVERAGE_PROCESS_CONFIG``,
``COVERAGE_PROCESS_START``: tests/vllm/coverage.toml's ``patch = subprocess``). An engine driver runs no connector
code itself: the connector runs in the engine-core and worker processes vLLM spawns. Yet traced, the driver's own
import of vLLM and its share of every request cost about as much CPU again as untraced. So the driver starts with
those variables renamed (``UNTRACED_PARENT_<name>``, which no coverage start-up reads), and this wrapper puts them
back into ``os.environ`` before it runs the script: the children the script starts inherit them and are traced.

    python -P tests/vllm/untraced_parent.py SCRIPT [ARGS...]
"""

from __future__ import annotations

import os
import runpy
import sys

RENAMED_PREFIX = "UNTRACED_PARENT_"


def main() -> None:
    for name in [name for name in os.environ if name.startswith(RENAMED_PREFIX)]:
        os.environ[name.removeprefix(RENAMED_PREFIX)] = os.environ.pop(name)
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
