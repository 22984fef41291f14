#!/usr/bin/env bash
# One device call: GPU-tier tests (the CUDA twins of the arena and store tests) and the tier benchmark on an H200.
# Run through the device tool from the repo root, carrying .whl (lmdb, zstandard, and -- since `import kvstore`
# brings in the server's client -- pyzmq, msgpack and prometheus-client wheels for Python 3.12):
#   bash benchmarks/run_on_h200.sh            (results land in $OUT)
# The wheels are not committed; fetch them here first (the device image has Python 3.12):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
#     --platform any -d .whl lmdb==3.0.0 zstandard==0.25.0 pyzmq==27.3.0 msgpack==1.2.4 prometheus-client==0.26.0
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/ 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
python3 benchmarks/bench_tiers.py --json "$@" 2>"$OUT/bench_tiers.log" | tee "$OUT/bench_tiers.jsonl"
