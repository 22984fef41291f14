"""The ``kvstore.store`` package's docstring is its module map: it names every module there, and only those."""

from __future__ import annotations

import re
from pathlib import Path

import kvstore.store

STORE_DIR = Path(kvstore.store.__file__).parent


def test_the_module_map_lists_exactly_the_modules_there() -> None:
    modules = {path.stem for path in STORE_DIR.glob("*.py") if path.stem != "__init__"}
    doc = kvstore.store.__doc__ or ""
    listed = set(re.findall(r"^- ``(\w+)``", doc, flags=re.MULTILINE))
    parts = set(re.findall(r"``(\w+)`` \(", doc))  # the fleet's parts, named inside its entry
    assert listed | parts == modules, "kvstore/store/__init__.py's docstring must list every module of the package"
