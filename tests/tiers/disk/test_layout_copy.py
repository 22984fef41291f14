"""The data dir's layout copy (``layout.json``): what a server reads at start instead of opening LMDB a first time,
kept equal to the info record by every writable open, and never trusted over it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvstore.errors import LayoutMismatchError, StorageError
from kvstore.layout import KVLayout
from kvstore.tiers.disk.layout_copy import LAYOUT_FILE, read_layout_copy, recorded_layout
from kvstore.tiers.disk.tier import DiskTier

CHUNK = 16
CAPACITY = 64 << 20


def open_tier(path: Path, layout: KVLayout, chunk_size: int = CHUNK) -> DiskTier:
    return DiskTier(path, layout, chunk_size, CAPACITY)


def test_a_new_dir_gets_the_copy_and_a_start_reads_it_without_opening_lmdb(
    tmp_path: Path, small_layout: KVLayout
) -> None:
    path = tmp_path / "data"
    assert recorded_layout(path) is None, "no data.mdb: a fresh dir"
    tier = open_tier(path, small_layout)
    try:
        assert read_layout_copy(path) == (small_layout, CHUNK)
        # LMDB cannot open an environment twice in one process: this answer did not open it
        assert recorded_layout(path) == (small_layout, CHUNK)
    finally:
        tier.close()


def test_a_dir_from_before_the_copy_is_probed_once_and_then_has_one(tmp_path: Path, small_layout: KVLayout) -> None:
    path = tmp_path / "data"
    open_tier(path, small_layout).close()
    (path / LAYOUT_FILE).unlink()
    assert recorded_layout(path) == (small_layout, CHUNK), "read from the info record, read-only"
    assert not (path / LAYOUT_FILE).exists(), "a probe writes nothing"
    open_tier(path, small_layout).close()
    assert read_layout_copy(path) == (small_layout, CHUNK)


@pytest.mark.parametrize("damage", ["not json", '{"layout": {"model_id": 3}}', '{"chunk_size": 16}', "chunk -1"])
def test_an_unreadable_copy_falls_back_to_the_record_and_the_next_open_rewrites_it(
    tmp_path: Path, small_layout: KVLayout, damage: str
) -> None:
    path = tmp_path / "data"
    open_tier(path, small_layout).close()
    copy = path / LAYOUT_FILE
    if damage == "chunk -1":
        copy.write_text(json.dumps({**json.loads(copy.read_text()), "chunk_size": -1}))
    else:
        copy.write_text(damage)
    assert read_layout_copy(path) is None
    assert recorded_layout(path) == (small_layout, CHUNK)
    open_tier(path, small_layout).close()
    assert read_layout_copy(path) == (small_layout, CHUNK)


def test_a_copy_that_disagrees_with_the_record_costs_one_refused_open_which_repairs_it(
    tmp_path: Path, small_layout: KVLayout
) -> None:
    path = tmp_path / "data"
    open_tier(path, small_layout).close()
    copy = path / LAYOUT_FILE
    copy.write_text(json.dumps({**json.loads(copy.read_text()), "chunk_size": 2 * CHUNK}))
    layout, chunk_size = recorded_layout(path) or (None, None)
    assert (layout, chunk_size) == (small_layout, 2 * CHUNK), "the copy is read as it is"
    with pytest.raises(LayoutMismatchError, match=f"chunk_size={CHUNK}"):
        open_tier(path, small_layout, chunk_size=2 * CHUNK)  # the record is the truth
    assert recorded_layout(path) == (small_layout, CHUNK), "the refused open repaired the copy"
    other = dataclasses.replace(small_layout, head_dim=2 * small_layout.head_dim)
    with pytest.raises(LayoutMismatchError):
        open_tier(path, other)
    assert read_layout_copy(path) == (small_layout, CHUNK), "another model's open leaves the copy as the record"


def test_a_damaged_data_file_behind_a_readable_copy_still_refuses_the_store(
    tmp_path: Path, small_layout: KVLayout
) -> None:
    path = tmp_path / "data"
    open_tier(path, small_layout).close()
    with open(path / "data.mdb", "r+b") as data_file:  # meta page 0's magic
        data_file.seek(16)
        data_file.write(b"\xff\xff\xff\xff")
    assert recorded_layout(path) == (small_layout, CHUNK), "the copy answers; the store's open finds the damage"
    with pytest.raises(StorageError, match=r"data\.mdb is damaged"):
        open_tier(path, small_layout)
    (path / LAYOUT_FILE).unlink()
    with pytest.raises(StorageError, match=r"data\.mdb is damaged"):
        recorded_layout(path)
