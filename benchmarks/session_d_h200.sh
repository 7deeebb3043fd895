#!/usr/bin/env bash
# Last H200 call of the session: the device tests and the conformance suite on the final tree,
# then the decode-kernel cases run C left out (llama-1b at batch 256; compile=True at batch 1).
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
$py -m pytest -q -rs -m device tests backends/cuda/tests -p no:cacheprovider >"$out/device-tests-final.log" 2>&1
tail -3 "$out/device-tests-final.log"
$py -m graphcap.testing -q --graphcap-json "$out/cuda-h200.json" >"$out/conformance-final.log" 2>&1
tail -2 "$out/conformance-final.log"
$py benchmarks/decode_kernels_h200.py "$out/decode-kernels-llama-1b-bs256.json" --models llama-1b \
    --batch-sizes 256 --budget-s 60 >"$out/decode-kernels-rest.log" 2>&1
$py benchmarks/decode_kernels_h200.py "$out/decode-kernels-compile.json" --models llama-8b \
    --batch-sizes 1 --with-compile --budget-s 150 >>"$out/decode-kernels-rest.log" 2>&1
grep -E "step|budget|compile" "$out/decode-kernels-rest.log" | tail -12
