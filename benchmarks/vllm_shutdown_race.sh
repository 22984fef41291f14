#!/usr/bin/env bash
# Is vLLM's traceback at Ctrl-C kvstore's doing? Alternates docs/vllm.md's quick-start server with and without the
# connector: start it, ask docs/examples/vllm_chat.py's two questions, send SIGINT to its process group (a terminal's
# Ctrl-C), then count the shutdown log's tracebacks and vLLM's "AsyncLLM output_handler failed" lines
# (vllm-project/vllm#48745: the output handler sees the engine core it just stopped). Run from the checkout after
# `make vllm`; RUNS pairs (default 5), each about 2-3 minutes on two cores; one line per run, on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python=.venv-vllm/bin/python
model_dir=$($python -c "import os; from kvstore.models import default_model_cache_dir; from kvstore.models.vllm_export import export_smollm2_for_vllm; print(export_smollm2_for_vllm(default_model_cache_dir(os.environ)))")
connector='{"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.connectors.vllm", "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"kvstore.data_dir": "'"$work"'/data"}}'
free_port() { $python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
for run in $(seq 1 "${RUNS:-5}"); do
  for arm in with without; do
    port=$(free_port)
    log="$work/$arm-$run.log"
    transfer=()
    if [ "$arm" = with ]; then transfer=(--kv-transfer-config "$connector"); fi
    setsid env VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_NUM_OF_RESERVED_CPU=1 $python -m vllm.entrypoints.openai.api_server \
      --model "$model_dir" --port "$port" --dtype float32 --enforce-eager --max-model-len 8192 \
      --no-enable-prefix-caching "${transfer[@]}" > "$log" 2>&1 &
    server=$!
    until curl -sf -o /dev/null "http://127.0.0.1:$port/health"; do
      kill -0 "$server" 2> /dev/null || { echo "$arm run $run: the server exited at start; its log:"; tail -n 30 "$log"; exit 1; }
      sleep 1
    done
    $python docs/examples/vllm_chat.py --port "$port" > "$work/$arm-$run.client"
    before=$(wc -l < "$log")
    started=$(date +%s.%N)
    kill -INT -- "-$server"
    wait "$server" || true
    exit_s=$(echo "$(date +%s.%N) - $started" | bc)
    shutdown=$(tail -n +"$((before + 1))" "$log")
    tracebacks=$(grep -c Traceback <<< "$shutdown" || true)
    handler=$(grep -c "output_handler failed" <<< "$shutdown" || true)
    printf '%s the connector, run %d: exit %.2f s after SIGINT, %d tracebacks (%d "AsyncLLM output_handler failed")\n' \
      "$arm" "$run" "$exit_s" "$tracebacks" "$handler"
  done
done
