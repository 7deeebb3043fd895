#!/usr/bin/env bash
# H200 run G (issue 11, final tree): every device test and the CUDA conformance suite, with
# the split-KV kernel as the default graph attention.
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
