"""Reliability figures for docs/benchmarks.md: kill -9 of a writer mid-storm, and flipped bytes in stored chunks.

Run from the repository root (it reuses the tests' storm writer):
    .venv/bin/python -m benchmarks.reliability [--kill-runs 5] [--flips 200] [--json]

- **kill -9**: each run starts ``tests.integration.storm_writer`` (a process storing sequence after sequence and
  printing ``durable N`` after each flush), kills it with SIGKILL at a random moment once it has acknowledged some
  durable sequences, reopens the data dir and reads back every sequence up to 64 past the last acknowledged one.
  Counted: acknowledged sequences lost (must be 0), chunks verified bit-identical, chunks read back different
  (must be 0), corrupt reads, and ``inspect --check`` problems after the reopen.
- **flipped bytes**: a data dir of 64 sequences; each trial flips one random bit of one random stored value -- a
  frame (the KV's compressed bytes) or a meta record -- behind the store's back (an LMDB write, as a disk bit rot
  the filesystem did not catch would look), opens the store and reads that sequence. Counted: flips detected
  (the chunk is refused: a shorter prefix, a counted corrupt read or a dropped record) and flips served as wrong
  KV (must be 0).

One JSON object per experiment with ``--json``; a readable line otherwise. Real processes, real LMDB files.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
from pathlib import Path

import lmdb
import torch

from kvstore import TieredStore
from kvstore.keys import num_chunks
from kvstore.store.inspection import check_data_dir
from kvstore.tiers.base import TierName
from kvstore.tiers.disk.format import frame_key
from tests.integration.storm_writer import CHUNK_SIZE, LAYOUT, config, sequence, storm_and_kill

REPO_ROOT = Path(__file__).resolve().parents[1]
_READ_PAST = 64


def kill_runs(num_runs: int, rng: random.Random, scratch: Path) -> dict[str, object]:
    lost = wrong = verified = corrupt = problems = acknowledged = 0
    for run in range(num_runs):
        data = scratch / f"storm-{run}"
        target = rng.randint(8, 96)  # acknowledged sequences before the kill: a random moment mid-storm
        durable = storm_and_kill(data, target, linger_s=rng.random() * 0.2)
        acknowledged += durable
        with TieredStore(LAYOUT, config(data)) as store:
            for seed in range(durable + _READ_PAST):
                tokens, kv = sequence(seed)
                result = store.retrieve(store.lookup(tokens))
                if not torch.equal(result.kv, kv[:, :, : result.num_prefix_tokens]):
                    wrong += 1
                else:
                    verified += num_chunks(result.num_prefix_tokens, CHUNK_SIZE)
                if seed < durable and result.num_prefix_tokens < tokens.shape[0]:
                    lost += 1
            disk = store.stats().tier(TierName.DISK)
            corrupt += disk.corrupt_reads if disk is not None else 0
        problems += check_data_dir(data).num_problems
        shutil.rmtree(data)
    return {
        "experiment": "kill_9_mid_write_storm",
        "runs": num_runs,
        "acknowledged_sequences": acknowledged,
        "acknowledged_lost": lost,
        "chunks_verified": verified,
        "sequences_read_back_different": wrong,
        "corrupt_reads": corrupt,
        "check_problems_after_reopen": problems,
    }


def flips(num_flips: int, rng: random.Random, scratch: Path) -> dict[str, object]:
    pristine = scratch / "pristine"
    num_sequences = 64
    with TieredStore(LAYOUT, config(pristine)) as store:
        for seed in range(num_sequences):
            store.store(*sequence(seed))
        store.flush()
    detected = served_wrong = 0
    by_kind = {"frame": 0, "meta": 0}
    for _ in range(num_flips):
        data = scratch / "trial"
        shutil.rmtree(data, ignore_errors=True)
        shutil.copytree(pristine, data)
        seed = rng.randrange(num_sequences)
        tokens, kv = sequence(seed)
        with TieredStore(LAYOUT, config(data)) as store:
            keys = [segment.key for segment in store.lookup(tokens).segments]
        kind = rng.choice(["frame", "meta"])
        by_kind[kind] += 1
        _flip_stored_bit(data, rng.choice(keys), kind, rng)
        with TieredStore(LAYOUT, config(data)) as store:
            result = store.retrieve(store.lookup(tokens))
            if not torch.equal(result.kv, kv[:, :, : result.num_prefix_tokens]):
                served_wrong += 1
            elif result.num_prefix_tokens < tokens.shape[0]:
                detected += 1
    shutil.rmtree(scratch / "trial", ignore_errors=True)
    return {
        "experiment": "flipped_bits_in_stored_values",
        "flips": num_flips,
        "frame_flips": by_kind["frame"],
        "meta_flips": by_kind["meta"],
        "detected": detected,
        "served_as_wrong_kv": served_wrong,
    }


def _flip_stored_bit(data: Path, key: bytes, kind: str, rng: random.Random) -> None:
    env = lmdb.open(str(data), max_dbs=8)
    try:
        with env.begin(write=True) as txn:
            db = env.open_db(b"payload" if kind == "frame" else b"meta", txn=txn)
            record = frame_key(key, 0) if kind == "frame" else key
            value = bytearray(txn.get(record, db=db))
            value[rng.randrange(len(value))] ^= 1 << rng.randrange(8)
            txn.put(record, bytes(value), db=db)
    finally:
        env.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kill-runs", type=int, default=5)
    parser.add_argument("--flips", type=int, default=200)
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="kvstore-reliability-") as scratch:
        rows = [kill_runs(args.kill_runs, rng, Path(scratch)), flips(args.flips, rng, Path(scratch))]
    for row in rows:
        print(json.dumps(row) if args.json else ", ".join(f"{name}={value}" for name, value in row.items()))


if __name__ == "__main__":
    main()
