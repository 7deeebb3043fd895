#!/usr/bin/env bash
# H200 run G (issue 11, final tree): every device test and the CUDA conformance suite, with
# the split-KV kernel as the default graph attention; then where a llama-8b graph step spends
# its device time at batch 1, 64 and 256 (prefill excluded).
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
timeout 300 $py -m pytest -q -rs -m device tests backends/cuda/tests -p no:cacheprovider \
    >"$out/device-tests-g.log" 2>&1
tail -3 "$out/device-tests-g.log"
timeout 200 $py -m graphcap.testing -q --graphcap-json "$out/cuda-h200.json" \
    >"$out/conformance-g.log" 2>&1
tail -2 "$out/conformance-g.log"
timeout 240 $py benchmarks/profile_decode.py "$out/profile-decode-g.json" --prompt-len 128 \
    --new-tokens 512 --cases llama-8b:bf16:1,llama-8b:bf16:64,llama-8b:bf16:256 \
    >"$out/profile-decode-g.log" 2>&1
grep -E '"batch"|device_ms_per_step"|wall|attention"' "$out/profile-decode-g.log"
