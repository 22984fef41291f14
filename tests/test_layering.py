"""Data flows one way (engine -> store -> tiers): no module imports from a layer above it."""

from __future__ import annotations

import ast
from pathlib import Path

import kvstore

PACKAGE_ROOT = Path(kvstore.__file__).parent

# A module in the key's package may not import any module under the listed prefixes (every rule whose key is the
# module or a package above it applies). The layers, bottom up (docs/contributing.md, "Layers"):
#   values (errors, layout, keys, plan, stats, surface, session, config, remote_address, ...)
#   <  storage: tiers (frames below disk and remote; tiers never import each other), content
#   <  store (the kvstore.store package)  <  server
#   wire (shared by client and server)  <  client  <  engines: connectors, blend, models;  tools: bench, cli on top.
_ABOVE_THE_STORE = ("kvstore.store", "kvstore.server", "kvstore.client", "kvstore.connectors", "kvstore.blend")
_TOOLS = ("kvstore.cli", "kvstore.bench")
_TIERS_BUT_BASE = (
    "kvstore.tiers.arena",
    "kvstore.tiers.cpu",
    "kvstore.tiers.gpu",
    "kvstore.tiers.disk",
    "kvstore.tiers.frames",
    "kvstore.tiers.remote",
    "kvstore.tiers.shared",
)
_VALUES = (*_ABOVE_THE_STORE, *_TOOLS, "kvstore.content", *_TIERS_BUT_BASE, "kvstore.wire", "kvstore.models")
# kvstore serve's checks that run before torch is imported: nothing that imports it, nor the server's rest
_BEFORE_TORCH = (
    *_TOOLS,
    "kvstore.store",
    "kvstore.tiers.base",
    "kvstore.layout",
    "kvstore.keys",
    "kvstore.presets",
    "kvstore.server.settings",
    "kvstore.server.loop",
    "kvstore.server.app",
)
_HEAVY_LIBRARIES = ("torch", "numpy", "numba", "lmdb", "zstandard", "transformers", "redis")
# kvstore bench's option checks, run before the benchmark is imported: the light modules below, the values the
# server's light checks use, and nothing that imports torch, numba or LMDB (tests/cli/test_refusals.py runs them)
_LIGHT_BENCH = ("option_checks", "rag_shape", "tier_options", "rebuild_options", "server_options",
                "multidoc_options", "vllm_blend_options")  # fmt: skip
_HEAVY_BENCH = tuple(
    f"kvstore.bench.{path.stem}"
    for path in (PACKAGE_ROOT / "bench").glob("*.py")
    if path.stem not in (*_LIGHT_BENCH, "__init__")
)
_BENCH_OPTIONS = (
    *_HEAVY_LIBRARIES,
    *(name for name in _BEFORE_TORCH if name != "kvstore.bench"),
    *_HEAVY_BENCH,
    "kvstore.blend.",
    "kvstore.models.",
)
_BENCH_OPTIONS_ALLOWED = ("kvstore.blend.config", "kvstore.models.random_init_names")
# Blending inside vLLM lives in kvstore.blend.vllm; the connector imports only its light modules (the contract, the
# request's choice, the span and the gate), never the pass, and nothing in kvstore.blend imports the connector.
_CONNECTOR_BLEND_ALLOWED = (
    "kvstore.blend.vllm.hook",
    "kvstore.blend.vllm.request_choice",
    "kvstore.blend.vllm.span",
    "kvstore.blend.vllm.gate",
)
FORBIDDEN = {
    # values
    "kvstore.errors": ("kvstore.",),
    "kvstore.version": ("kvstore.",),
    "kvstore.lazy_exports": ("kvstore.",),
    "kvstore.pids": ("kvstore.",),
    "kvstore.collector": ("kvstore.",),
    "kvstore.layout": (*_VALUES, "kvstore.config"),
    "kvstore.keys": (*_VALUES, "kvstore.config"),
    # the cut rule's name is read by the config and kvstore serve's light checks: nothing heavy, nothing above it
    "kvstore.chunking": (*_VALUES, *_HEAVY_LIBRARIES, "kvstore.config", "kvstore.keys", "kvstore.layout"),
    "kvstore.content_cut": (*_VALUES, "kvstore.config", "kvstore.keys", "kvstore.layout"),
    "kvstore.misses": (*_VALUES, "kvstore.config"),
    "kvstore.kv_part": (*_VALUES, "kvstore.config"),
    "kvstore.plan": (*_VALUES, "kvstore.config"),
    "kvstore.stats": (*_VALUES, "kvstore.config"),
    "kvstore.surface": (*_VALUES, "kvstore.config"),
    "kvstore.session": (*_VALUES, "kvstore.config"),
    "kvstore.remote_address": (*_VALUES, "kvstore.config"),
    "kvstore.presets": _VALUES,
    "kvstore.preset_names": (*_VALUES, *_BEFORE_TORCH, "kvstore.config"),  # read by the CLI before torch is imported
    "kvstore.data_dir": _VALUES,
    "kvstore.config": _VALUES,
    "kvstore.__init__": (),  # the package root: the public entry points, imported lazily (lazy_exports)
    # storage
    "kvstore.tiers": (*_ABOVE_THE_STORE, *_TOOLS, "kvstore.content", "kvstore.wire", "kvstore.config"),
    "kvstore.tiers.base": _TIERS_BUT_BASE,
    "kvstore.tiers.names": ("kvstore.",),  # imported by the values (config) and the CLI's light checks: nothing below
    # Tiers never call each other: the stored frame both the disk and the remote tier keep is a package of its own.
    "kvstore.tiers.frames": tuple(name for name in _TIERS_BUT_BASE if name != "kvstore.tiers.frames"),
    "kvstore.tiers.arena": tuple(name for name in _TIERS_BUT_BASE if name != "kvstore.tiers.arena"),
    "kvstore.tiers.cpu": ("kvstore.tiers.gpu", "kvstore.tiers.disk", "kvstore.tiers.frames", "kvstore.tiers.remote"),
    "kvstore.tiers.gpu": ("kvstore.tiers.cpu", "kvstore.tiers.disk", "kvstore.tiers.frames", "kvstore.tiers.remote"),
    "kvstore.tiers.shared": tuple(
        name for name in _TIERS_BUT_BASE if name not in ("kvstore.tiers.shared", "kvstore.tiers.frames")
    ),
    "kvstore.tiers.disk": ("kvstore.tiers.arena", "kvstore.tiers.cpu", "kvstore.tiers.gpu", "kvstore.tiers.remote"),
    "kvstore.tiers.remote": ("kvstore.tiers.arena", "kvstore.tiers.cpu", "kvstore.tiers.gpu", "kvstore.tiers.disk"),
    "kvstore.content": (*_ABOVE_THE_STORE, *_TOOLS, "kvstore.tiers", "kvstore.wire"),
    # the store: what TieredStore is built from must not reach back up into it
    "kvstore.store": (
        *_TOOLS,
        "kvstore.server",
        "kvstore.client",
        "kvstore.connectors",
        "kvstore.blend",
        "kvstore.wire",
    ),
    **{
        f"kvstore.store.{name}": ("kvstore.store.tiered",)  # only the coordinator is built from the others
        for name in (
            "borrowed_writes",
            "fleet",
            "fleet_publish",
            "fleet_sync",
            "inspection",
            "lookup_counts",
            "lookup_legs",
            "pins",
            "prefetch",
            "remote_reads",
            "retrieve_copies",
        )
    },
    "kvstore.store.tiered": (),
    # The wire is shared by both ends and imports neither (nor what only one end has).
    "kvstore.wire": (*_ABOVE_THE_STORE, *_TOOLS, "kvstore.content", *_TIERS_BUT_BASE),
    "kvstore.server": (*_TOOLS, "kvstore.client", "kvstore.connectors", "kvstore.blend"),
    # kvstore serve's checks before torch is imported (a mistake is refused in a fraction of a second): nothing that
    # imports it, nor the rest of the server
    **{f"kvstore.server.{name}": _BEFORE_TORCH for name in ("serve_flags", "serve_sources", "host_facts")},
    # The client never imports the server, nor the store it fronts.
    "kvstore.client": (
        *_TOOLS,
        "kvstore.server",
        "kvstore.store",
        "kvstore.content",
        *_TIERS_BUT_BASE,
        "kvstore.blend",
        "kvstore.connectors",
    ),
    # engines
    # An engine's connector reaches the store through a server only (its scheduler and workers are processes).
    "kvstore.connectors": (*_TOOLS, "kvstore.store", "kvstore.server", "kvstore.blend", "kvstore.content"),
    # The blender takes a StoreSurface: a store in process or a client; the connector builds on it, not the reverse.
    "kvstore.blend": (
        *_TOOLS,
        "kvstore.store",
        "kvstore.server",
        *_TIERS_BUT_BASE,
        "kvstore.content",
        "kvstore.connectors",
    ),
    "kvstore.models": (*_ABOVE_THE_STORE, *_TOOLS, "kvstore.tiers", "kvstore.content", "kvstore.wire"),
    # checked by kvstore bench before torch is imported
    "kvstore.models.random_init_names": (*_HEAVY_LIBRARIES, "kvstore.layout", "kvstore.models."),
    "kvstore.blend.config": (*_HEAVY_LIBRARIES, *_BEFORE_TORCH, "kvstore.blend.", "kvstore.models"),
    # tools
    "kvstore.bench": ("kvstore.cli",),
    **{f"kvstore.bench.{name}": _BENCH_OPTIONS for name in _LIGHT_BENCH},
    "kvstore.cli": (),
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


def rule_name(path: Path) -> str:
    """The name a module's rules are keyed by: its module name, ``kvstore.__init__`` for the package root (whose rule
    must not apply to every module below it)."""
    return "kvstore.__init__" if path == PACKAGE_ROOT / "__init__.py" else module_name(path)


def _under(module: str, prefix: str) -> bool:
    """``module`` is ``prefix`` or inside it (``kvstore.client`` is not under ``kvstore.cli``); a prefix ending in
    a dot matches everything below it."""
    if prefix.endswith("."):
        return module.startswith(prefix)
    return module == prefix or module.startswith(prefix + ".")


def _allowed(module: str) -> tuple[str, ...]:
    """The light modules a bench option module or a connector may import from packages its rule otherwise bans."""
    if module in {f"kvstore.bench.{name}" for name in _LIGHT_BENCH}:
        return _BENCH_OPTIONS_ALLOWED
    return _CONNECTOR_BLEND_ALLOWED if _under(module, "kvstore.connectors") else ()


def test_no_upward_imports() -> None:
    violations = []
    for path in PACKAGE_ROOT.rglob("*.py"):
        name = rule_name(path)
        for owner, banned in FORBIDDEN.items():
            if name == owner or name.startswith(owner + "."):
                violations += [
                    f"{name} imports {imported}"
                    for imported in imports_of(path)
                    if any(_under(imported, prefix) for prefix in banned) and imported not in _allowed(name)
                ]
    assert violations == []


def test_every_module_has_a_rule() -> None:
    """A new module states where it sits: its own key, or a package's above it."""
    unruled = sorted(
        name
        for name in map(rule_name, PACKAGE_ROOT.rglob("*.py"))
        if not any(name == owner or name.startswith(owner + ".") for owner in FORBIDDEN)
    )
    assert unruled == []


def test_no_relative_imports() -> None:
    relative = [
        str(path)
        for path in PACKAGE_ROOT.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.level
    ]
    assert relative == []
