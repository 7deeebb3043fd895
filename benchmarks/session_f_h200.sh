#!/usr/bin/env bash
# H200 run F (issue 11): the split-KV kernel with a branch-free span loop (accuracy, time,
# launch sweep); where a graph step's device time goes (profile, llama-8b at batch 1/64/256);
# the decode-kernel table with the kernel, with and without compile=True.
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
$py benchmarks/split_kv_h200.py "$out/split-kv-kernel-v2.json" >"$out/split-kv-kernel-v2.log" 2>&1
grep "'fill': 0.6" "$out/split-kv-kernel-v2.log" | head -6
$py benchmarks/profile_decode.py "$out/profile-decode-8b.json" --cases \
    llama-8b:bf16:1,llama-8b:bf16:64,llama-8b:bf16:256 --new-tokens 64 >"$out/profile.log" 2>&1
tail -3 "$out/profile.log"
$py benchmarks/decode_kernels_h200.py "$out/decode-kernels-split-kv-v2.json" --attentions split_kv \
    --with-compile --budget-s 270 >"$out/decode-kernels-split-kv-v2.log" 2>&1
grep -E "step|budget|error|Error" "$out/decode-kernels-split-kv-v2.log" | tail -20
