#!/usr/bin/env bash
# H200 run Y (issue 11): the two-pass argmax (graphcap.rollout.sampling.argmax_rows) in one
# short call, cold caches: the compiled step of llama-8b and llama-1b at batch 1 as runs L-X
# took it, then the device tests of greedy, sampled and compiled captures (fp32 tokens equal
# eager's and generate's). Files go straight to OUT (five), so a call cut short keeps what ran.
#   bash benchmarks/session_y_h200.sh OUT
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
cold_compile_caches
work=$out
for model in llama-8b llama-1b; do
    step_bench "$work" -mgraphcap.bench "$model" 1 graphcap-graph-compiled bs1-y 40
    grep -E '^graphcap-graph-compiled|Error' "$work/bench-$model-bs1-y.txt"
done
timeout 90 $py -m pytest -q -rs -m device -p no:cacheprovider tests/test_device_rollout.py \
    -k "greedy_graph or sampling or compiled" >"$work/device-tests-y.log" 2>&1
tail -1 "$work/device-tests-y.log"
