#!/usr/bin/env bash
# H200 run E (issue 11, split-KV kernel): the kernel alone (bf16 accuracy, time against SDPA
# with enable_gqa, launch-setting sweep), its device tests, then the decode-kernel table with
# the grouped-query SDPA and the split-KV kernel side by side.
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
$py benchmarks/split_kv_h200.py "$out/split-kv-kernel.json" >"$out/split-kv-kernel.log" 2>&1
tail -5 "$out/split-kv-kernel.log"
$py -m pytest -q -rs backends/cuda/tests/test_split_kv.py backends/cuda/tests/test_split_kv_cuda.py \
    -p no:cacheprovider >"$out/split-kv-device-tests.log" 2>&1
tail -3 "$out/split-kv-device-tests.log"
$py benchmarks/decode_kernels_h200.py "$out/decode-kernels-split-kv.json" \
    --attentions gqa_sdpa,split_kv --budget-s 280 >"$out/decode-kernels-split-kv.log" 2>&1
grep -E "step|budget|error|Error" "$out/decode-kernels-split-kv.log" | tail -20
