"""A damaged data dir is named in one line by every entry point, and nothing is written to it.

A ``data.mdb`` cut short used to kill ``kvstore inspect``, ``TieredStore`` and ``kvstore serve`` with SIGBUS (LMDB
maps the file and trusts its meta pages). The entry points run in this process (the check comes before any
mapping); one runs in a child process as well, so a regression shows up as a signal exit code there.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import KVLayout, StoreConfig, TieredStore
from kvstore.cli.main import main
from kvstore.errors import StorageError
from kvstore.tiers.base import TierName
from kvstore.tiers.disk.data_file_check import data_file_damage
from kvstore.tiers.disk.format import frame_key
from tests.factories import make_kv, make_tokens

REPO_ROOT = Path(__file__).resolve().parents[2]
CHUNK_SIZE = 64


def _config(path: Path) -> StoreConfig:
    return StoreConfig(tiers=(TierName.DISK,), chunk_size=CHUNK_SIZE, data_dir=path, disk_capacity_bytes=64 << 20)


def _filled_data_dir(path: Path, layout: KVLayout) -> None:
    with TieredStore(layout, _config(path)) as store:
        for seed in range(8):
            store.store(make_tokens(4 * CHUNK_SIZE, seed=seed), make_kv(layout, 4 * CHUNK_SIZE, seed=seed))
        store.flush()


def _fingerprint(path: Path) -> dict[str, tuple[str, int]]:
    """Every file's digest and mtime: equal before and after means nothing was written."""
    return {
        entry.name: (hashlib.sha256(entry.read_bytes()).hexdigest(), entry.stat().st_mtime_ns)
        for entry in sorted(path.iterdir())
    }


def _kvstore(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The CLI in this process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exited:
        main(list(args))
    captured = capsys.readouterr()
    return int(exited.value.code or 0), captured.out, captured.err


def _assert_one_line_error(code: int, stderr: str, *words: str) -> None:
    assert code == 1, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and all(word in lines[0] for word in words), stderr


@pytest.fixture(params=["half", "ninety_percent", "empty"])
def damaged(request: pytest.FixtureRequest, tmp_path: Path, small_layout: KVLayout) -> tuple[Path, str]:
    """A data dir whose ``data.mdb`` was cut to 50%, 90% or 0 bytes, and the word the errors must use."""
    path = tmp_path / "data"
    _filled_data_dir(path, small_layout)
    data_file = path / "data.mdb"
    size = data_file.stat().st_size
    keep = {"half": size // 2, "ninety_percent": size * 9 // 10, "empty": 0}[request.param]
    os.truncate(data_file, keep)
    return path, "empty" if keep == 0 else "truncated"


def test_inspect_names_the_damage_in_one_line(damaged: tuple[Path, str], capsys: pytest.CaptureFixture[str]) -> None:
    path, word = damaged
    before = _fingerprint(path)
    code, _, err = _kvstore(capsys, "inspect", "--data-dir", str(path))
    _assert_one_line_error(code, err, "data.mdb is damaged", word)
    assert _fingerprint(path) == before


def test_a_child_process_inspecting_it_is_not_killed(tmp_path: Path, small_layout: KVLayout) -> None:
    """The SIGBUS canary: in a child, a crash is an exit code instead of the end of the test run."""
    path = tmp_path / "data"
    _filled_data_dir(path, small_layout)
    os.truncate(path / "data.mdb", (path / "data.mdb").stat().st_size // 2)
    result = subprocess.run(
        [sys.executable, "-m", "kvstore.cli.main", "inspect", "--data-dir", str(path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode >= 0, f"killed by {signal.Signals(-result.returncode).name}: {result.stderr[-500:]}"
    _assert_one_line_error(result.returncode, result.stderr, "data.mdb is damaged", "truncated")


def test_inspect_check_reports_the_damage_as_a_problem(
    damaged: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    path, word = damaged
    before = _fingerprint(path)
    code, out, _ = _kvstore(capsys, "inspect", "--data-dir", str(path), "--check", "--json")
    assert code == 1
    report = json.loads(out)
    assert report["ok"] is False and report["num_problems"] == 1
    assert word in report["problems"][0] and "restore" in report["problems"][0]
    assert _fingerprint(path) == before


def test_opening_the_store_raises_a_storage_error_and_writes_nothing(
    damaged: tuple[Path, str], small_layout: KVLayout
) -> None:
    path, word = damaged
    before = _fingerprint(path)
    with pytest.raises(StorageError, match=f"data.mdb is damaged: .*{word}"):
        TieredStore(small_layout, _config(path))
    assert _fingerprint(path) == before


def test_serve_refuses_to_start_on_it(
    damaged: tuple[Path, str], tmp_path: Path, small_layout: KVLayout, capsys: pytest.CaptureFixture[str]
) -> None:
    path, word = damaged
    before = _fingerprint(path)
    layout_file = tmp_path / "layout.json"
    layout_file.write_text(small_layout.to_json())
    code, _, err = _kvstore(
        capsys, "serve", "--data-dir", str(path), "--port", "0", "--metrics-port", "0", "--layout",
        str(layout_file), "--chunk-size", str(CHUNK_SIZE), "--tiers", "cpu,disk", "--cpu-size", "10MiB",
    )  # fmt: skip
    _assert_one_line_error(code, err, "data.mdb is damaged", word)
    assert _fingerprint(path) == before


def test_serve_without_a_layout_refuses_it_too_and_writes_nothing(
    damaged: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --layout the server reads the data dir's recorded layout first: damage there used to pass for a
    fresh dir, the server answered /healthz 200, failed every client and wrote its document hits into the dir."""
    path, word = damaged
    before = _fingerprint(path)
    files_before = sorted(entry.name for entry in path.iterdir())
    code, _, err = _kvstore(
        capsys, "serve", "--data-dir", str(path), "--port", "0", "--metrics-port", "0", "--tiers", "cpu,disk",
        "--cpu-size", "10MiB",
    )  # fmt: skip
    _assert_one_line_error(code, err, "data.mdb is damaged", word)
    assert _fingerprint(path) == before and sorted(entry.name for entry in path.iterdir()) == files_before


def test_a_whole_data_file_passes_and_every_cut_is_caught(tmp_path: Path, small_layout: KVLayout) -> None:
    path = tmp_path / "data"
    _filled_data_dir(path, small_layout)
    whole = (path / "data.mdb").read_bytes()
    assert data_file_damage(path / "data.mdb") is None
    with lmdb.open(str(path), readonly=True, lock=False, max_dbs=4) as env:  # LMDB's own account of the file
        needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    assert needed <= len(whole)
    copy = tmp_path / "copy.mdb"

    @settings(max_examples=60, deadline=None)
    @given(st.integers(min_value=0, max_value=needed - 1))
    def cut_anywhere_is_damage(keep: int) -> None:
        copy.write_bytes(whole[:keep])
        assert data_file_damage(copy) is not None

    cut_anywhere_is_damage()


def test_a_file_that_is_not_lmdb_is_named(tmp_path: Path) -> None:
    path = tmp_path / "data"
    path.mkdir()
    (path / "data.mdb").write_bytes(b"not a database at all" * 500)
    with pytest.raises(StorageError, match="not an LMDB data file"):
        TieredStore(KVLayout(model_id="x", num_layers=1, num_kv_heads=1, head_dim=8), _config(path))


# -- damage inside the file: pages, not length ------------------------------------------------------------------


def _newest_meta(path: Path) -> tuple[int, int, int]:
    """(page size, offset of the newest meta page, its last page number)."""
    data = (path / "data.mdb").read_bytes()
    page_size = struct.unpack_from("=I", data, 40)[0]
    metas = [(struct.unpack_from("=QQ", data, index * page_size + 136), index) for index in (0, 1)]
    (last_page, _), index = max(metas, key=lambda meta: meta[0][1])
    return page_size, index * page_size, last_page


def test_a_flipped_bit_in_a_meta_pages_page_number_is_named_as_such(
    tmp_path: Path, small_layout: KVLayout, capsys: pytest.CaptureFixture[str]
) -> None:
    """A whole file whose newest meta page names a page far past the map: it was once reported as "truncated ...
    needs 137,550,704,640 bytes" of an intact file."""
    path = tmp_path / "data"
    _filled_data_dir(path, small_layout)
    page_size, meta, last_page = _newest_meta(path)
    with open(path / "data.mdb", "r+b") as data_file:
        data_file.seek(meta + 136)
        data_file.write(struct.pack("=Q", last_page | 1 << 25))
    code, _, err = _kvstore(capsys, "inspect", "--data-dir", str(path))
    where = f"meta page {meta // page_size} (at byte {meta:,}"
    _assert_one_line_error(code, err, "data.mdb is damaged", where, "past its own map size")
    assert "truncated" not in err
    with pytest.raises(StorageError, match="meta page"):
        TieredStore(small_layout, _config(path))


def test_a_meta_page_naming_too_few_pages_is_damage_not_a_bad_transaction(
    tmp_path: Path, small_layout: KVLayout
) -> None:
    """The other way round: pages of the trees lie past the last page the meta names (LMDB: page not found)."""
    path = tmp_path / "data"
    _filled_data_dir(path, small_layout)
    _, meta, last_page = _newest_meta(path)
    with open(path / "data.mdb", "r+b") as data_file:
        data_file.seek(meta + 136)
        data_file.write(struct.pack("=Q", last_page // 2))
    # where LMDB first meets a missing page depends on how the commits laid the trees out: at open or at a read
    damaged = r"data\.mdb is damaged: a (tree )?page (of its main tree )?is damaged"
    with pytest.raises(StorageError, match=damaged) as raised:
        TieredStore(small_layout, _config(path))
    assert "\n" not in str(raised.value)


def test_a_damaged_root_page_is_damage_not_another_kind_of_dir(
    tmp_path: Path, small_layout: KVLayout, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "data"
    _filled_data_dir(path, small_layout)
    page_size, meta, _ = _newest_meta(path)
    data = (path / "data.mdb").read_bytes()
    (main_root,) = struct.unpack_from("=Q", data, meta + 128)  # MDB_db[1] (the main tree): md_root
    with open(path / "data.mdb", "r+b") as data_file:
        data_file.seek(main_root * page_size + 10)
        data_file.write(struct.pack("=H", 0x0004))  # its flags say overflow page: not a tree page
    code, _, err = _kvstore(capsys, "inspect", "--data-dir", str(path))
    _assert_one_line_error(code, err, "data.mdb is damaged")
    assert "not a kvstore data dir" not in err


def test_a_chunk_behind_a_damaged_page_is_a_counted_miss_not_an_error(tmp_path: Path, small_layout: KVLayout) -> None:
    """A leaf entry of the payload tree pointing past the file (a flipped bit in its page number), met by a
    retrieve of an open store: LMDB raises page-not-found; the retrieve serves the chunks before it."""
    path = tmp_path / "data"
    _filled_data_dir(path, small_layout)
    tokens, kv = make_tokens(4 * CHUNK_SIZE, seed=3), make_kv(small_layout, 4 * CHUNK_SIZE, seed=3)
    with TieredStore(small_layout, _config(path)) as store:
        plan = store.lookup(tokens)
        victim = frame_key(plan.segments[2].key, 0)
        store.release(plan)
        data = (path / "data.mdb").read_bytes()
        # Leaf nodes naming the chunk's first frame: the live one, and copies in pages freed by later commits
        nodes = [at for at in range(len(data)) if data.startswith(victim, at) and data[at - 4] & 0x01]  # F_BIGDATA
        assert nodes, "a leaf node holding the overflow page number of the chunk's first frame"
        with open(path / "data.mdb", "r+b") as data_file:
            for node in nodes:
                data_file.seek(node + len(victim))
                data_file.write(struct.pack("=Q", 2**40))
        result = store.retrieve(store.lookup(tokens))
        assert result.num_prefix_tokens == 2 * CHUNK_SIZE
        assert torch.equal(result.kv, kv[:, :, : 2 * CHUNK_SIZE])
        assert store.stats().tier(TierName.DISK).corrupt_reads == 1
        assert store.store(tokens, kv).num_new_chunks == 0, "kept: a new copy would walk the damaged page"
        again = store.retrieve(store.lookup(tokens))
        assert again.num_prefix_tokens == 2 * CHUNK_SIZE and torch.equal(again.kv, result.kv)
        assert store.stats().tier(TierName.DISK).corrupt_reads == 2


def test_a_flipped_bit_in_the_recorded_layout_is_damage_not_a_bad_layout(
    tmp_path: Path, small_layout: KVLayout, capsys: pytest.CaptureFixture[str]
) -> None:
    """LMDB keeps no checksum of values: a flipped bit in the info record's JSON ('factor' -> 'factoR', found by a
    random flip) was reported as "cannot read a KV layout ... unexpected keyword argument", as if the caller's."""
    path = tmp_path / "data"
    _filled_data_dir(path, small_layout)
    data = (path / "data.mdb").read_bytes()
    assert data.count(b'"factor"') >= 1, "the layout record, in the info tree's leaf (and older copies of it)"
    (path / "data.mdb").write_bytes(data.replace(b'"factor"', b'"factoR"'))
    code, _, err = _kvstore(capsys, "inspect", "--data-dir", str(path))
    _assert_one_line_error(code, err, "data.mdb is damaged", "info record (layout, chunk size, capacity)", "factoR")
    with pytest.raises(StorageError, match=r"info record \(layout, chunk size, capacity\) is unreadable"):
        TieredStore(small_layout, _config(path))


@pytest.mark.parametrize(
    ("meta_index", "field_offset", "bit", "words"),
    [
        (0, 16, 0, ("meta page 0 (at byte 0) is damaged", "its magic is 0xbeefc0df")),
        (1, 16, 5, ("meta page 1 (at byte 4,096) is damaged", "its magic is")),
        (0, 20, 1, ("meta page 0 (at byte 0) is damaged", "data format version is 3")),
        (1, 20, 0, ("meta page 1 (at byte 4,096) is damaged", "data format version is 0")),
        (1, 10, 3, ("meta page 1 (at byte 4,096) is damaged", "do not mark a meta page")),
    ],
)
def test_a_flipped_bit_in_a_meta_pages_header_names_that_meta_page(
    tmp_path: Path,
    small_layout: KVLayout,
    capsys: pytest.CaptureFixture[str],
    meta_index: int,
    field_offset: int,
    bit: int,
    words: tuple[str, ...],
) -> None:
    """Random flips found these said "not an LMDB data file" (meta page 0's magic) or LMDB's "MDB_VERSION_MISMATCH:
    Database environment version mismatch" (a version): LMDB refuses a file with either meta page damaged."""
    path = tmp_path / "data"
    _filled_data_dir(path, small_layout)
    page_size, _, _ = _newest_meta(path)
    with open(path / "data.mdb", "r+b") as data_file:
        data_file.seek(meta_index * page_size + field_offset)
        byte = data_file.read(1)[0]
        data_file.seek(meta_index * page_size + field_offset)
        data_file.write(bytes([byte ^ 1 << bit]))
    code, _, err = _kvstore(capsys, "inspect", "--data-dir", str(path))
    _assert_one_line_error(code, err, "data.mdb is damaged", *words)
    with pytest.raises(StorageError, match=words[0].replace("(", r"\(").replace(")", r"\)")):
        TieredStore(small_layout, _config(path))


def test_a_last_page_one_bit_off_the_files_is_named_a_likely_flipped_bit(
    tmp_path: Path, small_layout: KVLayout, capsys: pytest.CaptureFixture[str]
) -> None:
    """Inside the map, so not caught by the map-size rule: a random flip gave "it is truncated" of a whole file."""
    path = tmp_path / "data"
    _filled_data_dir(path, small_layout)
    page_size, meta, _ = _newest_meta(path)
    num_pages = (path / "data.mdb").stat().st_size // page_size
    high_bit = 1 << (num_pages - 1).bit_length()  # a page number past the file, one bit away from its last
    with open(path / "data.mdb", "r+b") as data_file:
        data_file.seek(meta + 136)
        data_file.write(struct.pack("=Q", (num_pages - 1) | high_bit))
    code, _, err = _kvstore(capsys, "inspect", "--data-dir", str(path))
    _assert_one_line_error(code, err, "data.mdb is damaged", "differ in one bit", "flipped bit in that meta page")


def test_a_flipped_bit_in_a_meta_pages_tree_flags_is_damage_not_another_kind_of_file(
    tmp_path: Path, small_layout: KVLayout, capsys: pytest.CaptureFixture[str]
) -> None:
    """The free tree's md_flags in the newest meta page: LMDB said "MDB_INVALID: File is not an LMDB file"."""
    path = tmp_path / "data"
    _filled_data_dir(path, small_layout)
    _, meta, _ = _newest_meta(path)
    with open(path / "data.mdb", "r+b") as data_file:
        data_file.seek(meta + 44)
        byte = data_file.read(1)[0]
        data_file.seek(meta + 44)
        data_file.write(bytes([byte ^ 0x10]))
    code, _, err = _kvstore(capsys, "inspect", "--data-dir", str(path))
    _assert_one_line_error(code, err, "data.mdb is damaged", "a meta page's tree record is damaged")
    with pytest.raises(StorageError, match="a meta page's tree record is damaged"):
        TieredStore(small_layout, _config(path))


def test_a_value_whose_size_runs_past_the_file_is_refused_at_open(
    tmp_path: Path, small_layout: KVLayout, capsys: pytest.CaptureFixture[str]
) -> None:
    """A random flip set bit 10 of a leaf node's mn_hi (a big value's size): 21,954 bytes became 67,130,874, and the
    next read of that chunk killed the process with SIGBUS (py-lmdb touches a value's pages as it hands it out)."""
    path = tmp_path / "data"
    _filled_data_dir(path, small_layout)
    tokens = make_tokens(4 * CHUNK_SIZE, seed=3)
    with TieredStore(small_layout, _config(path)) as store:
        plan = store.lookup(tokens)
        victim = frame_key(plan.segments[1].key, 0)
        store.release(plan)
    data = (path / "data.mdb").read_bytes()
    nodes = [at for at in range(len(data)) if data.startswith(victim, at) and data[at - 4] & 0x01]  # F_BIGDATA
    assert nodes, "a leaf node holding the chunk's first frame on overflow pages"
    with open(path / "data.mdb", "r+b") as data_file:
        for node in nodes:  # mn_hi sits 6 bytes before the key: its bit 10 adds 64 GiB to the size
            data_file.seek(node - 6)
            data_file.write(struct.pack("=H", struct.unpack_from("=H", data, node - 6)[0] | 1 << 10))
    with pytest.raises(StorageError, match=r"a tree page is damaged: a value's size .* runs past the end of the file"):
        TieredStore(small_layout, _config(path))
    code, _, err = _kvstore(capsys, "inspect", "--data-dir", str(path))
    _assert_one_line_error(code, err, "data.mdb is damaged", "runs past the end of the file")
