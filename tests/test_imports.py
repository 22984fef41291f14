"""What the engine-facing modules load, in a fresh interpreter: an engine process pays only for what it uses.

An engine talks to a server (``kvstore.client``, the connectors' links and paged copies) or reads values
(``kvstore.plan``, ``kvstore.layout``). None of that may load the store, its tiers, the content index, the server,
or their libraries (LMDB, zstd, numba, prometheus_client, typer). Package ``__init__``s re-export lazily
(``kvstore.lazy_exports``) so that importing one module of a package does not import the rest.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import kvstore
from tests.import_graph import LoadGroup, import_closure, measure_loads

_HEAVY = ("lmdb", "zstandard", "numba", "prometheus_client", "typer", "rich", "transformers")
_STORE_SIDE = (
    "kvstore.store",
    "kvstore.server",
    "kvstore.tiers.disk",
    "kvstore.content",
    "kvstore.blend",
    "kvstore.cli",
)


def loaded_by(statement: str) -> set[str]:
    """The modules a fresh interpreter has loaded after ``statement``."""
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return set(json.loads(completed.stdout.splitlines()[-1]))


def _offenders(modules: set[str], banned: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == b or m.startswith(b + ".") for b in banned))


def test_the_client_side_loads_no_store_and_no_server() -> None:
    """All of an engine's modules in one interpreter (each costs a torch import): their union loads none of it."""
    loaded = loaded_by(
        "import kvstore.client\n"
        "from kvstore import Client, KVLayout\n"
        "import kvstore.connectors.store_link, kvstore.connectors.load_buffers, kvstore.connectors.paged\n"
        "import kvstore.connectors.settings, kvstore.connectors.embedded_server, kvstore.connectors.hook_clock\n"
        "import kvstore.wire.messages, kvstore.wire.values"
    )
    assert "kvstore.client" in loaded and "kvstore.connectors.paged" in loaded
    assert _offenders(loaded, _HEAVY) == []
    assert _offenders(loaded, _STORE_SIDE) == []


def test_values_modules_load_no_storage_library() -> None:
    loaded = loaded_by("import kvstore.plan, kvstore.layout, kvstore.keys, kvstore.stats, kvstore.surface")
    assert _offenders(loaded, _HEAVY) == []
    assert _offenders(loaded, (*_STORE_SIDE, "kvstore.client", "kvstore.wire", "kvstore.tiers.cpu")) == []


def test_the_lazy_names_still_resolve() -> None:
    loaded = loaded_by(
        "import kvstore, kvstore.blend, kvstore.content, kvstore.tiers, kvstore.server, kvstore.wire, kvstore.models\n"
        "for package in (kvstore, kvstore.blend, kvstore.content, kvstore.tiers, kvstore.server, kvstore.wire,\n"
        "                kvstore.models):\n"
        "    assert all(getattr(package, name) is not None for name in package.__all__), package\n"
        "    assert set(package.__all__) <= set(dir(package)), package"
    )
    assert {"kvstore.store", "kvstore.content.index", "kvstore.server.app", "kvstore.models.loading"} <= loaded


def test_an_unknown_name_is_an_attribute_error() -> None:
    import kvstore

    with pytest.raises(AttributeError, match="has no attribute 'Nonexistent'"):
        kvstore.Nonexistent  # noqa: B018


def test_the_benchmark_commands_load_no_torch_until_they_run() -> None:
    """``kvstore bench ...`` checks its options before the benchmark is imported: the command modules, with every
    option class and its defaults, load none of torch, numba or LMDB (``kvstore bench vllm``'s default and
    ``--serve`` options live in ``kvstore.bench.vllm_ttft`` and ``vllm_serve_options``, held light by this test
    alone), nor the ``--serve`` benchmark's servers and asyncio client."""
    loaded = loaded_by(
        "import kvstore.cli.bench_store, kvstore.cli.bench_blend, kvstore.cli.bench_server\n"
        "import kvstore.cli.bench_remote, kvstore.cli.bench_vllm"
    )
    assert "kvstore.bench.vllm_ttft" in loaded and "kvstore.bench.multidoc_options" in loaded
    assert "kvstore.bench.vllm_serve" not in loaded and "asyncio" not in loaded
    assert _offenders(loaded, ("torch", "numba", "lmdb", "transformers", "redis")) == []


_BENCH = Path(kvstore.__file__).parent / "bench"
_STORE_AND_SERVER = (
    "kvstore.store",
    "kvstore.server",
    "kvstore.client",
    "kvstore.content",
    "kvstore.tiers.base",
    "kvstore.tiers.cpu",
    "kvstore.tiers.disk",
    "kvstore.tiers.remote",
)


def _bench_modules() -> list[str]:
    return sorted(f"kvstore.bench.{path.stem}".removesuffix(".__init__") for path in _BENCH.glob("*.py"))


def test_each_bench_module_loads_only_what_its_own_import_statements_name() -> None:
    """Importing one ``kvstore.bench`` module (the package included) loads no kvstore module and no library that its
    own run-time import statements do not reach: ``kvstore bench remote`` does not pay for the vLLM benchmarks, nor
    the Valkey launcher for the store. Each module is imported in a child of one fresh interpreter that imported
    their libraries first (``tests/import_graph.py``); the benchmarks that run a store share one that imported it."""
    closures = {module: import_closure(module) for module in _bench_modules()}
    # every module runs the package's __init__ first: it imports nothing but what makes its names lazy
    assert closures["kvstore.bench"].modules == {*import_closure("kvstore").modules, "kvstore.bench"}
    store_users = tuple(module for module, closure in closures.items() if "kvstore.store" in closure.modules)
    shared = frozenset.intersection(*(closures[module].modules for module in store_users))
    groups = [
        LoadGroup(preload=(), modules=tuple(module for module in closures if module not in store_users)),
        LoadGroup(preload=tuple(sorted(shared)), modules=store_users),
    ]
    loaded = measure_loads(set().union(*(closure.libraries for closure in closures.values())), groups)
    unexpected = {}
    for module, closure in closures.items():
        outside = {name for name in loaded[module] if name.split(".")[0] != "kvstore" or name not in closure.modules}
        outside -= {name for name in outside if name.split(".")[0] in closure.libraries}
        if outside:
            unexpected[module] = sorted(outside)
    assert unexpected == {}
    assert loaded["kvstore.bench.tiers"] >= {"kvstore.bench.tiers", "kvstore.tiers.cpu"}  # the measure sees imports


def test_the_light_bench_modules_load_no_store_and_no_heavy_library() -> None:
    """The option modules, the Valkey launcher and the package itself, together in a fresh interpreter with nothing
    preloaded: none of torch, numpy, numba, LMDB, zstd, zmq or transformers, and none of the store, its tiers, the
    server or the client (the launcher alone needs redis)."""
    light = [
        module
        for module in _bench_modules()
        if not import_closure(module).libraries & {"torch", "numpy", "numba", "lmdb", "zstandard", "zmq", "redis"}
    ]
    assert {"kvstore.bench", "kvstore.bench.tier_options", "kvstore.bench.vllm_serve_options"} <= set(light)
    loaded = loaded_by(f"import {', '.join([*light, 'kvstore.bench.valkey_server'])}")
    assert _offenders(loaded, ("torch", "numpy", "numba", "lmdb", "zstandard", "zmq", "transformers")) == []
    assert _offenders(loaded, _STORE_AND_SERVER) == []
