#!/usr/bin/env bash
# H200 run V (issue 11): graphcap_cuda's few-row product kernel (2-64 rows), in two calls:
#   bash benchmarks/session_v_h200.sh OUT kernel   # its tests on the GPU, then the sweep
#   bash benchmarks/session_v_h200.sh OUT step     # the compiled step with and without it
# "kernel": the plugin's kernel tests (bf16 included), benchmarks/few_rows_h200.py's timings
# against cuBLAS. "step": graphcap bench of the compiled step (as in runs L-U) with
# few_rows.MAX_ROWS=0 (cuBLAS, as before) and as committed, llama-8b batch 16 and 64 and
# llama-1b batch 64, through benchmarks/bench_knobs.py.
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
cold_compile_caches
if [[ $2 == kernel ]]; then
    timeout 200 $py -m pytest -q -p no:cacheprovider backends/cuda/tests/test_few_rows.py \
        backends/cuda/tests/test_gemv.py >"$out/kernel-tests-v.log" 2>&1
    tail -2 "$out/kernel-tests-v.log"
    (cd benchmarks && timeout 330 $py few_rows_h200.py "$out/few-rows-v.json") \
        | tee "$out/few-rows-v.log" | grep -E 'step|rows 64:'
else
    for variant in cublas=few_rows.MAX_ROWS=0 few-rows=; do
        name=${variant%%=*}
        for case in llama-8b:16,64 llama-1b:64; do
            GRAPHCAP_KNOBS=${variant#*=} step_bench "$out" benchmarks/bench_knobs.py \
                "${case%%:*}" "${case#*:}" graphcap-graph-compiled "v-$name" 100
            echo "$name ${case%%:*}:"
            grep -E '^graphcap-graph-compiled|Error' "$out/bench-${case%%:*}-v-$name.txt"
        done
    done
fi
