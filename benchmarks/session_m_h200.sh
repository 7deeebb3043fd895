#!/usr/bin/env bash
# H200 run M (issue 11): compile=True with the attention's rotary function and q/k norms added
# to the compiled regions; the compiled device tests and `graphcap bench` of the compiled mode
# (with --fuse-projections) on llama-8b and llama-1b at batch 1, 64 and 256, 128 + 512 tokens.
#   bash benchmarks/session_m_h200.sh OUT
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
cold_compile_caches
timeout 45 $py -m pytest -q -rs -m device tests/test_device_rollout.py -k compiled \
    >"$out/device-tests-m.log" 2>&1
tail -2 "$out/device-tests-m.log"
for spec in llama-8b:75:150 llama-1b:45:90; do  # model:sweep budget:timeout (seconds)
    IFS=: read -r model budget limit <<<"$spec"
    timeout "$limit" $py -m graphcap.bench --model $model --batch-sizes 1,64,256 \
        --compile-batch-sizes 1,64,256 --prompt-len 128 --new-tokens 512 --repeats 3 \
        --warmup 1 --modes graphcap-graph-compiled --fuse-projections --budget-s "$budget" \
        --json "$out/bench-$model-m.json" >"$out/bench-$model-m.txt" 2>&1
    tail -6 "$out/bench-$model-m.txt"
done
# Where the fast step's time goes now (prefill removed): llama-8b at batch 1.
timeout 60 $py benchmarks/profile_decode.py "$out/profile-decode-m.json" --fast \
    --cases llama-8b:bf16:1 --new-tokens 256 >"$out/profile-m.log" 2>&1
grep -E '"(batch|kernels_per_step|device_ms_per_step|decode_ms_per_step_wall)"|gemm|other|attention"' \
    "$out/profile-m.log" | head -20
