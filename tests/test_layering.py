"""Data flows one way (engine -> store -> tiers): no module imports from a layer above it."""

from __future__ import annotations

import ast
from pathlib import Path

import kvstore

PACKAGE_ROOT = Path(kvstore.__file__).parent

# A module in the key's package may not import any module under the listed prefixes. The layers, bottom up:
#   values (errors, layout, keys, plan, stats, surface)  <  tiers, content  <  store  <  server
#   wire (shared by client and server)  <  client  <  connectors (an engine's side)
#   blend (an engine: it takes any StoreSurface), bench, cli on top.
_ABOVE_THE_STORE = ("kvstore.store", "kvstore.server", "kvstore.client", "kvstore.connectors", "kvstore.blend")
_TOOLS = ("kvstore.cli", "kvstore.bench")
_VALUES = (*_ABOVE_THE_STORE, *_TOOLS, "kvstore.content", "kvstore.tiers.disk", "kvstore.wire", "kvstore.config")
FORBIDDEN = {
    "kvstore.errors": ("kvstore.",),
    "kvstore.layout": _VALUES,
    "kvstore.keys": _VALUES,
    "kvstore.plan": _VALUES,
    "kvstore.stats": _VALUES,
    "kvstore.surface": _VALUES,
    "kvstore.tiers": (*_ABOVE_THE_STORE, *_TOOLS, "kvstore.content", "kvstore.wire", "kvstore.config"),
    "kvstore.content": (*_ABOVE_THE_STORE, *_TOOLS, "kvstore.tiers", "kvstore.wire"),
    # What the store is built from must not reach back up into it.
    "kvstore.sessions": (*_ABOVE_THE_STORE, *_TOOLS),
    "kvstore.prefetch": (*_ABOVE_THE_STORE, *_TOOLS),
    "kvstore.remote_reads": (*_ABOVE_THE_STORE, *_TOOLS),
    "kvstore.fleet_sync": (*_ABOVE_THE_STORE, *_TOOLS),
    "kvstore.fleet_publish": (*_ABOVE_THE_STORE, *_TOOLS),
    "kvstore.store": (
        *_TOOLS,
        "kvstore.server",
        "kvstore.client",
        "kvstore.connectors",
        "kvstore.blend",
        "kvstore.wire",
    ),
    "kvstore.models": (*_ABOVE_THE_STORE, *_TOOLS, "kvstore.tiers", "kvstore.content"),
    # The wire is shared by both ends and imports neither (nor what only one end has).
    "kvstore.wire": (*_ABOVE_THE_STORE, *_TOOLS, "kvstore.content", "kvstore.tiers.disk", "kvstore.sessions"),
    "kvstore.server": (*_TOOLS, "kvstore.client", "kvstore.connectors", "kvstore.blend"),
    # The client never imports the server, nor the store it fronts.
    "kvstore.client": (
        *_TOOLS,
        "kvstore.server",
        "kvstore.store",
        "kvstore.content",
        "kvstore.tiers.disk",
        "kvstore.blend",
        "kvstore.connectors",
    ),
    # An engine's connector reaches the store through a server only (its scheduler and workers are processes).
    "kvstore.connectors": (*_TOOLS, "kvstore.store", "kvstore.blend", "kvstore.content"),
    # The blender takes a StoreSurface: a store in process or a client.
    "kvstore.blend": (*_TOOLS, "kvstore.store", "kvstore.server", "kvstore.tiers.disk", "kvstore.content"),
    "kvstore.bench": ("kvstore.cli",),
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
