"""The consistency walk on real data dirs: clean, a flipped byte, a missing frame, frames of no chunk."""

from __future__ import annotations

import json
from pathlib import Path

import lmdb
import numpy as np
import pytest

from kvstore.cli.main import main
from kvstore.keys import as_token_array, prefix_keys
from kvstore.layout import KVLayout
from kvstore.tiers.base import ChunkRecord
from kvstore.tiers.disk.format import frame_key
from kvstore.tiers.disk.tier import DiskTier
from tests.factories import edit_payload, make_kv, make_tokens

CHUNK = 256


@pytest.fixture
def data_dir(tmp_path: Path, small_layout: KVLayout) -> tuple[Path, list[bytes]]:
    """A data dir with 3 chunks of 2 frames each (64 KiB frames), closed."""
    path = tmp_path / "data"
    tokens = as_token_array(make_tokens(3 * CHUNK))
    keys = prefix_keys(small_layout.namespace, tokens, CHUNK)
    kv = make_kv(small_layout, 3 * CHUNK)
    tier = DiskTier(path, small_layout, CHUNK, 64 << 20, frame_bytes=64 << 10)
    for index, key in enumerate(keys):
        record = ChunkRecord(key=key, source_start=index * CHUNK, tokens=tokens[index * CHUNK : (index + 1) * CHUNK])
        tier.put(record, kv[:, :, index * CHUNK : (index + 1) * CHUNK])
    tier.close()
    return path, list(keys)


def check(path: Path, layout: KVLayout):  # type: ignore[no-untyped-def]
    tier = DiskTier(path, layout, CHUNK, 64 << 20, frame_bytes=64 << 10, read_only=True)
    try:
        return tier.check()
    finally:
        tier.close()


def test_a_clean_data_dir_checks_clean(data_dir: tuple[Path, list[bytes]], small_layout: KVLayout) -> None:
    report = check(data_dir[0], small_layout)
    assert report.ok and report.problems == ()
    assert (report.num_chunks, report.num_frames, report.num_unfinished_frames) == (3, 6, 0)
    assert report.stored_bytes > 0


def test_a_flipped_byte_and_a_missing_frame_are_reported(
    data_dir: tuple[Path, list[bytes]], small_layout: KVLayout
) -> None:
    path, keys = data_dir
    with edit_payload(path) as (txn, db):
        value = bytearray(txn.get(frame_key(keys[0], 1), db=db))
        value[len(value) // 2] ^= 0x01
        txn.put(frame_key(keys[0], 1), bytes(value), db=db)
        txn.delete(frame_key(keys[2], 0), db=db)
    report = check(path, small_layout)
    assert not report.ok and report.num_problems == 2
    assert any(keys[0].hex() in line and "frame 1 is corrupt" in line for line in report.problems)
    assert any(keys[2].hex() in line and "frame 0 of 2 is missing" in line for line in report.problems)


def test_frames_of_no_chunk_are_counted_not_problems(
    data_dir: tuple[Path, list[bytes]], small_layout: KVLayout
) -> None:
    path, keys = data_dir
    with edit_payload(path) as (txn, db):
        txn.put(frame_key(bytes(16 * [7]), 0), np.arange(100, dtype=np.uint8).tobytes(), db=db)  # type: ignore[arg-type]
        txn.put(frame_key(keys[1], 5), b"stray", db=db)
    report = check(path, small_layout)
    assert report.num_unfinished_frames == 1
    assert report.problems == (f"chunk {keys[1].hex()}: stray frame 5",)


def test_a_corrupt_meta_record_is_reported_by_inspect_check(
    data_dir: tuple[Path, list[bytes]], capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvstore inspect --check`` on a chunk whose meta record fails its checksum: one problem naming the chunk."""
    path, keys = data_dir
    env = lmdb.open(str(path), max_dbs=8)
    try:
        with env.begin(write=True) as txn:
            meta_db = env.open_db(b"meta", txn=txn)
            value = bytearray(txn.get(keys[1], db=meta_db))
            value[20] ^= 0x04  # inside raw_bytes: still well-formed, only the checksum can tell
            txn.put(keys[1], bytes(value), db=meta_db)
    finally:
        env.close()
    with pytest.raises(SystemExit) as exited:
        main(["inspect", "--data-dir", str(path), "--check", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert exited.value.code == 1 and report["ok"] is False and report["num_problems"] == 1
    assert report["problems"] == [f"chunk {keys[1].hex()}: meta record unreadable (checksum or format)"]
    assert report["num_chunks"] == 2 and report["num_unfinished_frames"] == 2, "its frames belong to no chunk now"
