#!/usr/bin/env bash
# H200 run X (issue 11): the compiled step's own work (graphcap.rollout.regions.
# compiled_bookkeeping: masks, write positions, token choice), in two calls, cold caches:
#   bash benchmarks/session_x_h200.sh OUT ab      # device tests; the step with and without it
#   bash benchmarks/session_x_h200.sh OUT final   # the figures of issue 11, as run U took them
# "ab": every device test (fp32 tokens of captures equal eager's), then graphcap bench of the
# compiled step (benchmarks/bench_knobs.py) with regions.COMPILE_BOOKKEEPING=0, as committed,
# and with inductor's coordinate-descent tuning: llama-8b batch 1, llama-1b batch 1 and 64.
# "final": session_u_h200.sh's calls (llama-8b batch 1 beside HF static cache + compile, the
# bench first in its call; batch 64 / 256 of both models compiled; CUDA conformance; profile),
# plus llama-1b batch 1. One tarball comes back (run-x-PART.tar).
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
cold_compile_caches
work=/tmp/x-$2
mkdir -p "$work"
if [[ $2 == ab ]]; then
    timeout 240 $py -m pytest -q -rs -m device -p no:cacheprovider tests backends/cuda/tests \
        >"$work/device-tests-x.log" 2>&1
    tail -1 "$work/device-tests-x.log"
    cdt=inductor.coordinate_descent_tuning=1
    for variant in off=graphcap.rollout.regions.COMPILE_BOOKKEEPING=0 now= cdt=$cdt; do
        for case in llama-8b:1 llama-1b:1,64; do
            model=${case%%:*}
            GRAPHCAP_KNOBS=${variant#*=} step_bench "$work" benchmarks/bench_knobs.py "$model" \
                "${case#*:}" graphcap-graph-compiled "x-${variant%%=*}" 90
            echo "${variant%%=*} $model:"
            grep -E '^graphcap-graph-compiled|Error' "$work/bench-$model-x-${variant%%=*}.txt"
        done
    done
else
    shown_bench "$work" llama-8b 1 hf-static-compile,graphcap-graph,graphcap-graph-compiled bs1-x 150
    shown_bench "$work" llama-8b 64,256 graphcap-graph-compiled bs64-256-x 90
    shown_bench "$work" llama-1b 1,64,256 graphcap-graph-compiled bs1-64-256-x 70
    timeout 120 $py -m graphcap.testing -q --graphcap-json "$work/cuda-h200.json" \
        >"$work/conformance-x.log" 2>&1
    tail -1 "$work/conformance-x.log"
    timeout 90 $py benchmarks/profile_decode.py "$work/profile-decode-x.json" --fast \
        --cases llama-8b:bf16:1 --new-tokens 256 >"$work/profile-x.log" 2>&1
    grep -E '"(kernels_per_step|device_ms_per_step|decode_ms_per_step_wall)"' "$work/profile-x.log"
fi
tar -cf "$out/run-x-$2.tar" -C /tmp "x-$2"
