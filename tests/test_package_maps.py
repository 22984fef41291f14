"""The module maps in package docstrings list exactly the modules that are there.

A package's ``__init__`` docstring may carry a module map, so that a newcomer finds the module for a job without
opening every file. A map that omits a module hides it; one that names a module that is gone sends the reader
looking for it. This test reads the maps of the packages in ``MAPPED_PACKAGES`` and compares them with the package's
directory.

What counts as a module map: the docstring lines that open with a bullet and a double-backquoted name, one entry
per module, its job after a colon; an entry may wrap onto indented lines::

    - ``writer``: the one writer thread: group commit of writes, deletes, access times and syncs;

Every other line (prose, a bullet that does not start with a backquoted name) is not part of the map, so prose may
mention modules freely. A module is a ``.py`` file of the package directory other than ``__init__.py``, or a
subdirectory with an ``__init__.py`` (a subpackage). The check reads files only: it imports nothing.

A package whose map is rewritten to this form is added to ``MAPPED_PACKAGES``.
"""

from __future__ import annotations

import ast
import pkgutil
import re
from pathlib import Path

import pytest

import kvstore

KVSTORE_DIR = Path(kvstore.__file__).parent

MAPPED_PACKAGES = [
    "kvstore.blend",
    "kvstore.blend.vllm",
    "kvstore.connectors",
    "kvstore.connectors.vllm",
    "kvstore.content",
    "kvstore.data_dir",
    "kvstore.models",
    "kvstore.server",
    "kvstore.server.kv_events",
    "kvstore.server.usage",
    "kvstore.store",
    "kvstore.tiers",
    "kvstore.tiers.disk",
    "kvstore.tiers.frames",
    "kvstore.tiers.remote",
    "kvstore.wire",
]

_MAP_ENTRY = re.compile(r"^- ``([A-Za-z_][A-Za-z0-9_]*)``")


def map_entries(docstring: str) -> list[str]:
    """The module names a docstring's map lists, in order (empty when it has no map)."""
    return [match.group(1) for line in docstring.splitlines() if (match := _MAP_ENTRY.match(line.strip()))]


def package_dir(package: str) -> Path:
    return KVSTORE_DIR.joinpath(*package.split(".")[1:])


def package_docstring(package: str) -> str:
    source = (package_dir(package) / "__init__.py").read_text()
    return ast.get_docstring(ast.parse(source)) or ""


def modules_of(package: str) -> set[str]:
    """The modules and subpackages in the package's directory (``pkgutil`` finds both without importing them)."""
    return {module.name for module in pkgutil.iter_modules([str(package_dir(package))])}


def test_a_map_is_the_bullets_that_open_with_a_backquoted_name() -> None:
    docstring = """Job.

    - ``writer``: the writer thread;
    - ``commit``: whole or not at all, a job too long
      for one line;
    - the tier: ``tier`` (a bullet that opens with prose is not an entry);
    Prose naming ``reader`` is not an entry either.
    """
    assert map_entries(docstring) == ["writer", "commit"]
    assert map_entries("Job, and no map.") == []


@pytest.mark.parametrize("package", MAPPED_PACKAGES)
def test_the_module_map_lists_exactly_the_modules_that_are_there(package: str) -> None:
    entries = map_entries(package_docstring(package))
    assert entries, f"{package}: its __init__ docstring has no module map (lines '- ``module``: job')"
    repeated = sorted({name for name in entries if entries.count(name) > 1})
    assert not repeated, f"{package}: its module map lists {repeated} more than once"
    present = modules_of(package)
    missing = sorted(present - set(entries))
    assert not missing, f"{package}: its module map omits {missing}; add a line '- ``module``: job' for each"
    gone = sorted(set(entries) - present)
    assert not gone, f"{package}: its module map names {gone}, which are not in {package_dir(package)}"
