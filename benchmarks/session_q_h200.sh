#!/usr/bin/env bash
# H200 run Q (issue 11), part 1: the levers alone (benchmarks/decode_levers_h200.py): the
# balanced split-KV chunks against the previous kernel, and one-row products through inductor's
# coordinate-descent tuning / GEMMs through max-autotune against cuBLAS.
#   git show b293e7d:backends/cuda/graphcap_cuda/split_kv.py \
#       | sed 's/graphcap_cuda::/graphcap_baseline::/' >benchmarks/baseline_split_kv.py
#   bash benchmarks/session_q_h200.sh OUT 1
# Part 2: graphcap_cuda's one-row kernel (gemv.py) tested in bf16 and swept against cuBLAS, with
# the split-KV file's tests (they found shared memory outgrown by fp32 blocks in part 1).
#   bash benchmarks/session_q_h200.sh OUT 2
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
cold_compile_caches
case $2 in
1)
    timeout 150 $py -m pytest -q -rs backends/cuda/tests/test_split_kv_cuda.py \
        backends/cuda/tests/test_split_kv.py >"$out/split-kv-tests-q.log" 2>&1
    tail -3 "$out/split-kv-tests-q.log"
    cd benchmarks
    timeout 540 $py decode_levers_h200.py "$out/decode-levers.json" balance,gemv,autotune \
        baseline_split_kv.py >"$out/decode-levers.log" 2>&1
    tail -40 "$out/decode-levers.log"
    ;;
2)
    timeout 150 $py -m pytest -q -rs backends/cuda/tests/test_gemv.py \
        backends/cuda/tests/test_split_kv.py >"$out/kernel-tests-q2.log" 2>&1
    tail -3 "$out/kernel-tests-q2.log"
    cd benchmarks
    timeout 420 $py decode_levers_h200.py "$out/decode-levers-one-row.json" one_row \
        >"$out/decode-levers-one-row.log" 2>&1
    tail -12 "$out/decode-levers-one-row.log"
    ;;
esac
