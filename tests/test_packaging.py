"""What the wheel holds, read from pyproject.toml as setuptools reads it: kvstore's packages and its licence, not a
data dir that ``make run`` left next to them (issue 27)."""

from __future__ import annotations

import tomllib
from pathlib import Path

from setuptools import find_namespace_packages

REPO_ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


def test_the_packages_found_are_kvstores_and_not_a_data_dir_beside_them(tmp_path: Path) -> None:
    """setuptools' ``packages.find`` finds namespace packages, so any directory whose name matches is packaged."""
    for package in ("kvstore", "kvstore/cli", "kvstore/tiers/disk"):
        (tmp_path / package).mkdir(parents=True)
        (tmp_path / package / "__init__.py").write_text("")
    for leftover in ("kvstore-data", "kvstore_scratch", "kvstore-data/sub"):
        (tmp_path / leftover).mkdir(parents=True, exist_ok=True)
        (tmp_path / leftover / "data.mdb").write_bytes(b"")
    find = PYPROJECT["tool"]["setuptools"]["packages"]["find"]
    found = find_namespace_packages(where=str(tmp_path), include=find["include"])
    assert sorted(found) == ["kvstore", "kvstore.cli", "kvstore.tiers", "kvstore.tiers.disk"]


def test_the_licence_the_metadata_names_is_shipped() -> None:
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = (REPO_ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"] and "END OF TERMS AND CONDITIONS" in text


def test_the_wheel_ships_the_bench_commands_and_not_the_test_harnesses() -> None:
    """``kvstore bench`` is part of the product (its package is shipped); what only the tests start, such as the
    Valkey cluster in ``tests/harness``, is not."""
    find = PYPROJECT["tool"]["setuptools"]["packages"]["find"]
    found = find_namespace_packages(where=str(REPO_ROOT), include=find["include"])
    assert "kvstore.bench" in found and (REPO_ROOT / "tests" / "harness" / "valkey_cluster.py").is_file()
    assert [package for package in found if package.split(".")[0] != "kvstore"] == []
