"""The ``kvstore`` command end to end on real data dirs: output, exit codes, one-line errors."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest

import kvstore
from kvstore import StoreConfig, TieredStore
from kvstore.cli.main import main
from kvstore.keys import as_token_array, prefix_keys
from kvstore.presets import preset_layout
from kvstore.tiers.base import TierName
from kvstore.tiers.disk.format import frame_key
from kvstore.tiers.disk.tier import DiskTier
from tests.factories import make_kv, make_tokens


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run the CLI in-process; returns (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    captured = capsys.readouterr()
    code = exited.value.code
    return (code if isinstance(code, int) else 0), captured.out, captured.err


def assert_one_line_error(stderr: str, fragment: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvstore: error:") and fragment in lines[0], stderr
    assert "Traceback" not in stderr


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data dir filled by ``kvstore demo`` (3 documents x 1000 tokens of SmolLM2-shaped KV: 12 chunks)."""
    path = tmp_path_factory.mktemp("cli") / "data"
    result = subprocess.run(
        [sys.executable, "-m", "kvstore.cli.main", "demo", "--data-dir", str(path)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 0, result.stderr
    assert "bit-identical to what was stored: yes" in result.stdout
    assert "1000 tokens cached (disk: 1000)" in result.stdout, "the partial last chunk is found by content"
    assert "8 blend segments cover 2000 tokens at new positions; 70 tokens to compute" in result.stdout
    return path


def test_demo_runs_in_process_and_is_idempotent(demo_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["demo", "--data-dir", str(demo_dir)], capsys)
    assert code == 0 and "0 new chunks" in out and "bit-identical to what was stored: yes" in out


def test_inspect_json_summarises_the_data_dir(demo_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["inspect", "--data-dir", str(demo_dir), "--json"], capsys)
    summary = json.loads(out)
    assert code == 0
    assert summary["num_chunks"] == 12 and summary["num_partial_chunks"] == 3 and summary["num_sequences"] == 3
    assert summary["num_tokens"] == 3000 and summary["chunk_size"] == 256
    assert summary["raw_bytes"] == 3000 * preset_layout("smollm2-135m").bytes_per_token
    assert summary["compression_ratio"] > 1.2
    assert summary["layout_namespace"] == preset_layout("smollm2-135m").namespace.hex()
    assert summary["oldest_access"] <= summary["newest_access"]


def test_inspect_table_and_one_chunk(demo_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["inspect", "--data-dir", str(demo_dir)], capsys)
    assert code == 0 and "compression ratio" in out and "SmolLM2-135M" in out
    key = _first_key_of(demo_dir)
    code, out, _ = run(["inspect", "--data-dir", str(demo_dir), "--key", key, "--json"], capsys)
    chunk = json.loads(out)
    assert code == 0 and chunk["key"] == key and chunk["source_start"] == 0 and chunk["num_tokens"] == 256
    code, _, err = run(["inspect", "--data-dir", str(demo_dir), "--key", "00" * 16], capsys)
    assert code == 1 and "no chunk" in err


def _first_key_of(path: Path) -> str:
    from kvstore.tiers.disk.tier import DiskTier

    tier = DiskTier.open_existing(path)
    try:
        return next(chunk.key.hex() for chunk in tier.iter_records() if chunk.source_start == 0)
    finally:
        tier.close()


@pytest.mark.parametrize(
    ("argv", "fragment", "expected_code"),
    [
        (["inspect", "--data-dir", "/nonexistent/kvstore"], "not a kvstore data dir", 1),
        (["inspect", "--key", "xyz"], "32 hex digits", 1),
        (["evict", "--data-dir", "/tmp"], "exactly one of", 1),
        (["evict", "--all", "--bytes", "1GiB"], "exactly one of", 1),
        (["evict", "--bytes", "lots"], "is not a size", 1),
        (["bench", "tiers", "--tiers", "disk,cpu"], "out of order", 1),
        (["bench", "tiers", "--layouts", "gpt-9"], "unknown layout preset", 1),
        (["inspect", "--bogus"], "No such option", 2),
        (["inspect", "--url", "tcp://127.0.0.1:1", "--data-dir", "d"], "give one of them", 1),
        (["evict", "--url", "tcp://127.0.0.1:1", "--data-dir", "d", "--all", "--yes"], "give one of them", 1),
        (["serve", "--disk-path", "/tmp/kv"], "--disk-path was renamed --data-dir", 2),
        (["inspect", "--path", "/tmp/kv"], "--path was renamed --data-dir", 2),
        (["serve", "--cpu-size", "0.25"], "0.25 bytes, not a whole number of bytes", 1),
        (["--log-level", "loud", "inspect"], "--log-level", 2),
    ],
)
def test_bad_input_is_one_line_and_a_non_zero_exit(
    argv: list[str], fragment: str, expected_code: int, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(argv, capsys)
    assert code == expected_code
    assert_one_line_error(err, fragment)


def _filled_dir(path: Path, num_sequences: int) -> list[bytes]:
    layout = preset_layout("smollm2-135m")
    config = StoreConfig(tiers=(TierName.DISK,), chunk_size=16, data_dir=path, disk_capacity_bytes=256 << 20)
    keys: list[bytes] = []
    with TieredStore(layout, config) as store:
        for seed in range(num_sequences):
            tokens = make_tokens(32, seed)
            store.store(tokens, make_kv(layout, 32, seed))
            keys += prefix_keys(layout.namespace, as_token_array(tokens), 16)
    return keys


EVICTION_REPORT_KEYS = {
    "data_dir", "url", "evicted_chunks", "freed_bytes", "remaining_chunks", "not_found", "still_cached",
}  # fmt: skip
"""``evict --json``'s keys, the same offline and through a server (tests/server/test_admin_cli.py checks the other)."""


def test_evict_by_key_by_bytes_and_all(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "data"
    keys = _filled_dir(path, 6)  # 12 chunks
    code, out, _ = run(
        ["evict", "--data-dir", str(path), "--key", keys[0].hex(), "--key", keys[1].hex(), "--json"], capsys
    )
    report = json.loads(out)
    assert code == 0 and report["evicted_chunks"] == 2 and report["remaining_chunks"] == {"disk": 10}
    assert set(report) == EVICTION_REPORT_KEYS and report["data_dir"] == str(path) and report["url"] is None
    code, out, _ = run(["evict", "--data-dir", str(path), "--key", keys[0].hex()], capsys)
    assert code == 1 and "not found" in out
    code, _, err = run(["evict", "--data-dir", str(path), "--bytes", "10G"], capsys)  # no terminal to confirm on
    assert code == 1 and DiskTier.open_existing(path, read_only=True).stats().num_chunks == 10, "--bytes asks too"
    assert_one_line_error(err, f"add --yes (drop chunks in {path} until 9.31 GiB are freed, least recent first?)")
    code, out, _ = run(["evict", "--data-dir", str(path), "--bytes", "1MiB", "--yes", "--json"], capsys)
    report = json.loads(out)
    assert code == 0 and report["freed_bytes"]["disk"] >= 1 << 20 and report["remaining_chunks"]["disk"] < 10
    code, _, err = run(["evict", "--data-dir", str(path), "--all"], capsys)  # no terminal to confirm on
    assert code == 1
    assert_one_line_error(err, "--yes")
    code, out, _ = run(["evict", "--data-dir", str(path), "--all", "--yes", "--json"], capsys)
    assert code == 0 and json.loads(out)["remaining_chunks"] == {"disk": 0}


def test_evict_refuses_a_data_dir_a_live_process_holds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "data"
    _filled_dir(path, 1)
    holder_code = (
        "import sys; from pathlib import Path; from kvstore import StoreConfig, TieredStore;"
        "from kvstore.presets import preset_layout; from kvstore.tiers.base import TierName;"
        f"config = StoreConfig(tiers=(TierName.DISK,), chunk_size=16, data_dir=Path({str(path)!r}),"
        " disk_capacity_bytes=256 << 20);"
        "store = TieredStore(preset_layout('smollm2-135m'), config); print('ready', flush=True); sys.stdin.read()"
    )
    with subprocess.Popen(
        [sys.executable, "-c", holder_code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as holder:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == "ready"
        code, _, err = run(["evict", "--data-dir", str(path), "--all", "--yes"], capsys)
        inspect_code, out, _ = run(["inspect", "--data-dir", str(path), "--json"], capsys)
        holder.stdin.close()
    assert code == 1
    assert_one_line_error(err, f"held by process {holder.pid}")
    assert inspect_code == 0 and json.loads(out)["num_chunks"] == 2, (
        "inspect is read-only and works beside a live store"
    )


def test_bench_tiers_json_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "tiers", "--json", "--tiers", "cpu,disk", "--layouts", "smollm2-135m", "--chunk-size", "8"]
    argv += ["--cpu-size", "2MiB", "--disk-size", "2MiB", "--repeats", "1", "--disk-repeats", "1"]
    code, out, _ = run([*argv, "--scratch-dir", str(tmp_path)], capsys)
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0
    assert [(row["tier"], row["op"]) for row in rows] == [
        ("cpu", "put"),
        ("cpu", "get"),
        ("disk", "put"),
        ("disk", "get_cold"),
        ("disk", "get_cold_prefetch"),
    ]
    for row in rows:
        assert row["GBps"] > 0 and row["baseline_GBps"] > 0 and row["ratio"] > 0
    assert rows[2]["compression_ratio"] > 1.0


def test_bench_tiers_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "tiers", "--tiers", "cpu", "--layouts", "smollm2-135m", "--chunk-size", "8"]
    code, out, _ = run([*argv, "--cpu-size", "2MiB", "--repeats", "1"], capsys)
    assert code == 0 and "ratio" in out and "baseline = host copy_" in out


@pytest.mark.parametrize(
    "command",
    [[], ["inspect"], ["evict"], ["demo"], ["serve"], ["bench"], ["bench", "tiers"], ["bench", "index"]],
    ids=" ".join,
)
def test_help_has_examples(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """The README promises an example in every command's --help (kvstore --help and bench --help had none)."""
    code, out, _ = run([*command, "--help"], capsys)
    examples = out.split("Example", 1)[-1]
    assert code == 0 and "Example" in out
    assert any(line.strip().startswith(" ".join(["kvstore", *command])) for line in examples.splitlines())


def test_inspect_check_passes_on_a_clean_dir_and_fails_on_a_corrupt_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "data"
    keys = _filled_dir(path, 2)
    code, out, _ = run(["inspect", "--data-dir", str(path), "--check", "--json"], capsys)
    report = json.loads(out)
    assert code == 0 and report["ok"] and report["num_chunks"] == 4
    data_file = path / "data.mdb"
    raw = bytearray(data_file.read_bytes())
    tier_frame = _frame_bytes(path, keys[0])
    position = raw.find(tier_frame)
    raw[position + len(tier_frame) // 2] ^= 0x10
    data_file.write_bytes(bytes(raw))
    code, out, _ = run(["inspect", "--data-dir", str(path), "--check"], capsys)
    assert code == 1 and out.splitlines()[0].endswith(": 1 problem") and keys[0].hex() in out


def _frame_bytes(path: Path, key: bytes) -> bytes:
    env = lmdb.open(str(path), max_dbs=8, readonly=True, lock=False)
    with env.begin() as txn:
        value = bytes(txn.get(frame_key(key, 0), db=env.open_db(b"payload", txn=txn)))  # type: ignore[arg-type]
    env.close()
    return value


def test_bench_index_json_row(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["bench", "index", "--chunks", "120", "--queries", "5", "--json"], capsys)
    (row,) = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and row["bench"] == "fingerprint_index" and row["chunks"] == 120
    assert row["recall"] == 1.0 and row["false_positives"] == 0 and row["doc_coverage"] == 1.0
    assert row["recall_after_evicting_10pct"] == 1.0 and row["bytes_per_chunk"] > 0
    assert row["match_ms_median"] > 0 and row["baseline_ms_median"] > 0
    code, _, err = run(["bench", "index", "--chunks", "0"], capsys)
    assert code == 1
    assert_one_line_error(err, "positive")


def test_version_names_the_release_and_the_distribution(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["--version"], capsys)
    assert code == 0 and out.strip() == f"kvstore {kvstore.__version__} (distribution kvstore-llm)"
    assert kvstore.__version__ == importlib.metadata.version("kvstore-llm")
    assert (Path(kvstore.__file__).parent / "py.typed").is_file()
