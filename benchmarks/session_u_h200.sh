#!/usr/bin/env bash
# H200 run U (issue 11): the figures of the tree with dependent launches and combo kernels (run
# T chose them), in one call, cold caches: graphcap bench as in runs L-S (bf16, 128 + 512 tokens,
# --fuse-projections, 3 repeats) of llama-8b batch 1 beside HF static cache + compile, llama-8b
# and llama-1b batch 64 and 256 compiled; CUDA conformance; the profile of llama-8b batch 1.
#   bash benchmarks/session_u_h200.sh OUT
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
cold_compile_caches

shown_bench "$out" llama-8b 1 hf-static-compile,graphcap-graph,graphcap-graph-compiled bs1-u 150
shown_bench "$out" llama-8b 64,256 graphcap-graph-compiled bs64-256-u 90
shown_bench "$out" llama-1b 64,256 graphcap-graph-compiled bs64-256-u 50
timeout 120 $py -m graphcap.testing -q --graphcap-json "$out/cuda-h200.json" \
    >"$out/conformance-u.log" 2>&1
tail -1 "$out/conformance-u.log"
timeout 90 $py benchmarks/profile_decode.py "$out/profile-decode-u.json" --fast \
    --cases llama-8b:bf16:1 --new-tokens 256 >"$out/profile-u.log" 2>&1
grep -E '"(kernels_per_step|device_ms_per_step|decode_ms_per_step_wall)"|gemm|other|attention"' \
    "$out/profile-u.log" | head -10
