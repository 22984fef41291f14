"""Data flows one way (engine -> store -> tiers): no module imports from a layer above it."""

from __future__ import annotations

import ast
from pathlib import Path

import kvstore

PACKAGE_ROOT = Path(kvstore.__file__).parent

# A module in the key's package may not import any module under the listed prefixes.
FORBIDDEN = {
    "kvstore.tiers": (
        "kvstore.store",
        "kvstore.cli",
        "kvstore.bench",
        "kvstore.server",
        "kvstore.blend",
        "kvstore.config",
    ),
    "kvstore.layout": ("kvstore.store", "kvstore.tiers", "kvstore.cli", "kvstore.bench"),
    "kvstore.keys": ("kvstore.store", "kvstore.tiers", "kvstore.cli", "kvstore.bench"),
    "kvstore.errors": ("kvstore.",),
    "kvstore.models": ("kvstore.store", "kvstore.tiers", "kvstore.blend", "kvstore.cli", "kvstore.bench"),
    "kvstore.store": ("kvstore.cli", "kvstore.bench", "kvstore.server"),
    # What the store is built from must not reach back up into it (the blender, an engine, may).
    "kvstore.plan": ("kvstore.store", "kvstore.cli", "kvstore.bench", "kvstore.server"),
    "kvstore.sessions": ("kvstore.store", "kvstore.cli", "kvstore.bench", "kvstore.server"),
    "kvstore.prefetch": ("kvstore.store", "kvstore.cli", "kvstore.bench", "kvstore.server"),
    **{
        f"kvstore.blend.{part}": ("kvstore.store", "kvstore.cli", "kvstore.bench", "kvstore.server", "kvstore.tiers")
        for part in ("index", "fingerprint_table", "rolling_hash", "catalog", "registration", "strikes", "aliases")
    },
    "kvstore.bench": ("kvstore.cli",),
    "kvstore.server": ("kvstore.cli", "kvstore.bench", "kvstore.client"),
    "kvstore.client": ("kvstore.cli", "kvstore.bench"),
    # An engine's connector reaches the store through a server only (its scheduler and workers are processes).
    "kvstore.connectors": ("kvstore.cli", "kvstore.bench", "kvstore.store", "kvstore.blend"),
}


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _under(module: str, prefix: str) -> bool:
    """``module`` is ``prefix`` or inside it (``kvstore.client`` is not under ``kvstore.cli``); a prefix ending in
    a dot matches everything below it."""
    if prefix.endswith("."):
        return module.startswith(prefix)
    return module == prefix or module.startswith(prefix + ".")


def test_no_upward_imports() -> None:
    violations = []
    for path in PACKAGE_ROOT.rglob("*.py"):
        name = module_name(path)
        for owner, banned in FORBIDDEN.items():
            if name == owner or name.startswith(owner + "."):
                violations += [
                    f"{name} imports {imported}"
                    for imported in imports_of(path)
                    if any(_under(imported, prefix) for prefix in banned)
                ]
    assert violations == []


def test_no_relative_imports() -> None:
    relative = [
        str(path)
        for path in PACKAGE_ROOT.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.level
    ]
    assert relative == []
