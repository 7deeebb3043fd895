#!/usr/bin/env bash
# H200 run H (issue 11, final tree): `graphcap bench` on llama-8b at the issue's batch sizes
# (128 prompt + 512 new tokens, bf16, greedy, EOS off) with HF static cache + compile and the
# compiled graph step at batch 1 in the same run; then the continuous-batching benchmark.
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
cache=$(mktemp -d)
export TORCHINDUCTOR_CACHE_DIR=$cache/inductor TRITON_CACHE_DIR=$cache/triton  # cold compiles
timeout 330 $py -m graphcap.bench --model llama-8b --batch-sizes 1,64,256 \
    --compile-batch-sizes 1 --prompt-len 128 --new-tokens 512 --repeats 3 --warmup 1 \
    --modes hf-static-compile,graphcap-graph,graphcap-graph-compiled --budget-s 260 \
    --json "$out/bench-llama-8b-issue11.json" >"$out/bench-llama-8b-issue11.txt" 2>&1
tail -25 "$out/bench-llama-8b-issue11.txt"
timeout 200 $py benchmarks/continuous_h200.py "$out/continuous-h200.json" \
    >"$out/continuous-h200.log" 2>&1
tail -12 "$out/continuous-h200.log"
