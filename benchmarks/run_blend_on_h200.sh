#!/usr/bin/env bash
# One device call: the blender's CUDA twin tests, the scattered-query attention kernels
# (benchmarks/attention_selected.py), then `kvstore bench multi-doc-qa` (issue 4's speed figures) on a
# random-init model of Llama-3.1-8B's shape in bfloat16: 5 documents x 3000 tokens, all five in every query in a new
# order (15,060-token prompts), modes full / prefix / blend (0.15) / reuse, with the documents' KV in the gpu, the cpu
# and the disk tier (one tier per run, so every load comes from that tier; the disk runs read through the page
# cache; the cpu tier once more with the masked-sdpa attention instead of flex). Documents are stored alone (--warm-up alone), so every one of them is reused at a new position and no
# query starts with a cached prefix: the blend's worst case for TTFT (with the default preamble warm-up a query's
# first document would be an exact prefix hit). Chunks of 256 tokens, the store's default. The cpu-tier run also checks the target (--expected-ttft-gain 3.3; its exit code is saved). A shuffle run
# (derangements) on the cpu tier closes, after a profile of two cpu-tier blends (benchmarks/profile_blend.py). Results land in $OUT: *.jsonl (one JSON row per mode), *.log, *.rc.
#
# Run through the device tool from the repo root, carrying .whl:
#   bash benchmarks/run_blend_on_h200.sh                  (extra arguments go to every bench run: --num-queries 40)
# .whl holds lmdb and zstandard (as for run_on_h200.sh) plus transformers and its dependencies for Python 3.12;
# fetch them here first (numpy and torch wheels pip pulls in are skipped below: the image's own builds are used):
#   python3 -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     lmdb==3.0.0 zstandard==0.25.0 transformers==5.24.0
set -uo pipefail
WHEELS=$(ls .whl/*.whl | grep -v -E '/(numpy|torch|nvidia_[a-z_]*)-[0-9]')
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHEELS || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$OUT/gpu.txt"
python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/blend/test_blender.py \
  tests/blend/test_query_attention.py tests/test_store.py 2>&1 | tail -15 | tee "$OUT/blend_gpu_tests.txt"
python3 benchmarks/attention_selected.py --keys 15060 --queries 2302 2>"$OUT/attention_selected.log" \
  | tee "$OUT/attention_selected.jsonl"

COMMON=(--random-init llama3.1-8b --device cuda --dtype bfloat16 --num-documents 5 --document-tokens 3000
        --docs-per-query 5 --num-queries 20 --modes full,prefix,blend,reuse --warm-up alone --chunk-size 256 --json)
run() {  # name, then bench arguments
  local name=$1; shift
  python3 -m kvstore.cli.main --log-level info bench "$@" 2>"$OUT/$name.log" | tee "$OUT/$name.jsonl"
  echo "${PIPESTATUS[0]}" > "$OUT/$name.rc"
}
run multi_doc_qa_gpu multi-doc-qa "${COMMON[@]}" --tiers gpu "$@"
run multi_doc_qa_cpu multi-doc-qa "${COMMON[@]}" --tiers cpu --expected-ttft-gain 3.3 "$@"
run multi_doc_qa_cpu_sdpa multi-doc-qa "${COMMON[@]}" --tiers cpu --attention sdpa --modes full,blend "$@"
run multi_doc_qa_disk multi-doc-qa "${COMMON[@]}" --tiers disk "$@"
python3 benchmarks/profile_blend.py "${COMMON[@]}" --tiers cpu --num-queries 2 --modes blend \
  >/dev/null 2>"$OUT/profile_blend_cpu.txt"
run shuffle_cpu shuffle "${COMMON[@]}" --tiers cpu --num-queries 10 "$@"
tail -n +1 "$OUT"/*.rc
