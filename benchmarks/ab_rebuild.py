"""A/B of the store's open with blending on (the content index rebuilt from the disk tier) across two revisions.

Times ``TieredStore(layout, StoreConfig(tiers=("disk",), enable_blend=True))`` on the data dir that
``kvstore bench rebuild --chunks N`` built (run that first), once per side per repeat, sides alternating, each in a
fresh interpreter that imports kvstore from that side's tree: ``--before`` is a git revision (extracted with
``git archive`` into a temporary dir), the other side the working tree, or ``--after DIR`` (a checkout holding a
proposed change, e.g. a ``git worktree`` with a patch applied). Prints one JSON object per open and a summary line
of medians (wall and CPU seconds, garbage-collector seconds).

Example::

    .venv/bin/python benchmarks/ab_rebuild.py --chunks 1000000 --before 24097e8 --repeats 2
    .venv/bin/python benchmarks/ab_rebuild.py --chunks 1000000 --before HEAD --after /tmp/one-pass-worktree
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Runs in the child: kvstore from argv[1] only (the editable install's finder is dropped), one timed open.
_CHILD = r"""
import gc, json, sys, time
sys.meta_path[:] = [finder for finder in sys.meta_path if "editable" not in repr(finder).lower()]
sys.path.insert(0, sys.argv[1])
from pathlib import Path
import kvstore
from kvstore.config import StoreConfig
from kvstore.layout import KVDtype, KVLayout
from kvstore.store import TieredStore
from kvstore.tiers.base import TierName
assert kvstore.__file__.startswith(sys.argv[1]), kvstore.__file__
layout = KVLayout(model_id="kvstore-bench-rebuild", num_layers=1, num_kv_heads=1, head_dim=int(sys.argv[4]),
                  dtype=KVDtype.FLOAT16)
config = StoreConfig(tiers=(TierName.DISK,), data_dir=Path(sys.argv[2]), disk_capacity_bytes=int(sys.argv[3]),
                     enable_blend=True)
gc_s, started = [0.0], [0.0]
def on_collection(phase, info):
    if phase == "start":
        started[0] = time.perf_counter()
    else:
        gc_s[0] += time.perf_counter() - started[0]
gc.callbacks.append(on_collection)
wall, cpu = time.perf_counter(), time.process_time()
store = TieredStore(layout, config)
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
gc.callbacks.remove(on_collection)
entries = store.stats().catalog.num_entries
store.close()
print(json.dumps({"rebuild_s": round(wall, 3), "rebuild_cpu_s": round(cpu, 3), "rebuild_gc_s": round(gc_s[0], 3),
                  "index_entries": entries}))
"""


def extract(revision: str, into: Path) -> Path:
    archive = into / "kvstore.tar"
    with archive.open("wb") as out:
        subprocess.run(["git", "-C", str(REPO), "archive", revision, "kvstore"], check=True, stdout=out)
    with tarfile.open(archive) as tar:
        tar.extractall(into / "tree", filter="data")
    return into / "tree"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=1_000_000)
    parser.add_argument("--before", required=True, help="git revision of side A (side B: the working tree)")
    parser.add_argument("--after", type=Path, default=None, help="a checkout to time as side B instead")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from kvstore.bench.rebuild import MANIFEST_NAME, RebuildBenchOptions, capacity_bytes

    options = RebuildBenchOptions(num_chunks=args.chunks, seed=args.seed)
    data_dir = options.resolved_data_dir
    if not (data_dir / MANIFEST_NAME).exists():
        sys.exit(f"no data dir at {data_dir}; run: kvstore bench rebuild --chunks {args.chunks} first")
    with tempfile.TemporaryDirectory(prefix="kvstore-ab-") as scratch:
        after = ("working tree", REPO) if args.after is None else (str(args.after), args.after.resolve())
        sides = {args.before: extract(args.before, Path(scratch)), after[0]: after[1]}
        rows: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
        for repeat in range(args.repeats):
            for name, tree in sides.items():
                command = [sys.executable, "-c", _CHILD, str(tree), str(data_dir), str(capacity_bytes(options)),
                           str(options.head_dim)]  # fmt: skip
                result = subprocess.run(command, check=True, capture_output=True, text=True, cwd=scratch)
                row = json.loads(result.stdout.strip().splitlines()[-1])
                print(json.dumps({"side": name, "repeat": repeat, "chunks": options.num_documents * 12} | row))
                rows[name].append(row)
    for name, side_rows in rows.items():
        medians = {key: statistics.median(row[key] for row in side_rows) for key in side_rows[0]}
        print(f"{name}: median over {len(side_rows)} opens: " + ", ".join(f"{k}={v:g}" for k, v in medians.items()))


if __name__ == "__main__":
    main()
