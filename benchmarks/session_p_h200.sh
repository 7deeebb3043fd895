#!/usr/bin/env bash
# H200 run P (issue 11): the split-KV kernel combines its chunks in the last one to finish (one
# kernel a launch instead of two): device tests, the kernel's default timings (as in run N),
# and llama-1b batch 1 in graphcap bench (first call and step, HF static + compile alongside).
#   bash benchmarks/session_p_h200.sh OUT
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
cold_compile_caches
timeout 120 $py -m pytest -q -rs -m device tests backends/cuda/tests >"$out/device-tests-p.log" 2>&1
tail -3 "$out/device-tests-p.log"
timeout 60 $py benchmarks/split_kv_tuning_h200.py "$out/split-kv-one-kernel.json" default \
    >"$out/split-kv-one-kernel.log" 2>&1
tail -6 "$out/split-kv-one-kernel.log"
timeout 150 $py -m graphcap.bench --model llama-1b --batch-sizes 1 --compile-batch-sizes 1 \
    --prompt-len 128 --new-tokens 512 --repeats 3 --warmup 1 --fuse-projections --budget-s 90 \
    --modes hf-static-compile,graphcap-graph,graphcap-graph-compiled \
    --json "$out/bench-llama-1b-bs1-p.json" >"$out/bench-llama-1b-bs1-p.txt" 2>&1
tail -6 "$out/bench-llama-1b-bs1-p.txt"
