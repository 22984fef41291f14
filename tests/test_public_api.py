"""Every package's __all__ is sorted, complete for what the package means to export, and importable."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import kvstore

ENGINE_PACKAGES = ("kvstore.connectors.vllm",)
"""Packages that import a serving engine: checked where the engine is installed (tests/vllm)."""

PACKAGES = sorted(
    [kvstore.__name__]
    + [
        info.name
        for info in pkgutil.walk_packages(kvstore.__path__, "kvstore.")
        if info.ispkg and info.name not in ENGINE_PACKAGES
    ]
)


@pytest.mark.parametrize("package_name", PACKAGES)
def test_all_is_sorted_and_importable(package_name: str) -> None:
    package = importlib.import_module(package_name)
    exported = package.__all__
    assert list(exported) == sorted(exported), f"{package_name}.__all__ is not sorted"
    for name in exported:
        assert hasattr(package, name), f"{package_name}.__all__ names {name}, which it does not define"


def test_top_level_surface() -> None:
    for name in ("TieredStore", "KVLayout", "StoreConfig", "KVStoreError", "LayoutMismatchError"):
        assert name in kvstore.__all__
