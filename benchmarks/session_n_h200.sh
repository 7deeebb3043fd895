#!/usr/bin/env bash
# H200 run N (issue 11): what is left of the decode step after run M.
#   bash benchmarks/session_n_h200.sh OUT 1   compiled device tests (K/V writes now compiled
#                                              too); the split-KV kernel's launch settings
#   bash benchmarks/session_n_h200.sh OUT 2   profiles of the compiled step (compile=True,
#                                              fuse_projections) at batch 64 and 256 (llama-8b)
#                                              and batch 1 (llama-1b)
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
cold_compile_caches
if [[ $2 == 1 ]]; then
    timeout 90 $py -m pytest -q -rs -m device tests/test_device_rollout.py -k compiled \
        >"$out/device-tests-n.log" 2>&1
    tail -2 "$out/device-tests-n.log"
    timeout 420 $py benchmarks/split_kv_tuning_h200.py "$out/split-kv-tuning.json" \
        >"$out/split-kv-tuning.log" 2>&1
    tail -3 "$out/split-kv-tuning.log"
else
    timeout 500 $py benchmarks/profile_decode.py "$out/profile-decode-n.json" --fast \
        --cases llama-8b:bf16:64,llama-8b:bf16:256,llama-1b:bf16:1 --new-tokens 256 \
        >"$out/profile-n.log" 2>&1
    grep -E '"(batch|kernels_per_step|device_ms_per_step|decode_ms_per_step_wall)"|gemm|other|attention"' \
        "$out/profile-n.log" | head -40
fi
