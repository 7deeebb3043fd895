#!/usr/bin/env bash
# H200 run R (issue 11): compile=True captures route batch-1 projections through the CUDA
# plugin's one-row kernel (graphcap_cuda/gemv.py, chosen from run Q's sweep). graphcap bench as
# in runs L-P (bf16, 128 + 512 tokens, --fuse-projections, 3 repeats, cold caches).
#   bash benchmarks/session_r_h200.sh OUT 1   device tests (the kernels' files too); llama-8b
#                                             batch 1 with HF static + compile
#   bash benchmarks/session_r_h200.sh OUT 2   llama-8b batch 1 compiled without the product;
#                                             llama-1b batch 1 with HF, then without the product;
#                                             profile of llama-8b batch 1
#   bash benchmarks/session_r_h200.sh OUT 3   bf16 teacher-forced logits at batch 1 (the product
#                                             serves); llama-8b batch 64, 256 in the default mode
#   bash benchmarks/session_r_h200.sh OUT 4   CUDA conformance (with the one-row product check);
#                                             llama-1b batch 64, 256 compiled
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
cold_compile_caches

bench() {  # SCRIPT MODEL SIZES MODES TAG BUDGET
    step_bench "$out" "$@"
    tail -6 "$out/bench-$2-$5.txt"
}
with=-mgraphcap.bench
without=benchmarks/bench_without_one_row.py

case $2 in
1)
    timeout 200 $py -m pytest -q -rs -m device tests backends/cuda/tests \
        >"$out/device-tests-r.log" 2>&1
    tail -3 "$out/device-tests-r.log"
    timeout 100 $py -m pytest -q -rs backends/cuda/tests/test_gemv.py \
        backends/cuda/tests/test_split_kv.py >"$out/kernel-tests-r.log" 2>&1
    tail -1 "$out/kernel-tests-r.log"
    bench $with llama-8b 1 hf-static-compile,graphcap-graph,graphcap-graph-compiled bs1-r 150
    ;;
2)
    bench $without llama-8b 1 graphcap-graph-compiled bs1-r-without 60
    bench $with llama-1b 1 hf-static-compile,graphcap-graph,graphcap-graph-compiled bs1-r 90
    bench $without llama-1b 1 graphcap-graph-compiled bs1-r-without 40
    timeout 90 $py benchmarks/profile_decode.py "$out/profile-decode-r.json" --fast \
        --cases llama-8b:bf16:1 --new-tokens 256 >"$out/profile-r.log" 2>&1
    grep -E '"(kernels_per_step|device_ms_per_step|decode_ms_per_step_wall)"|gemm|other|attention"' \
        "$out/profile-r.log" | head -10
    ;;
3)
    timeout 200 $py benchmarks/logits_vs_fp32_h200.py "$out/logits-vs-fp32-bs1-r.json" --batch 1 \
        >"$out/logits-vs-fp32-bs1-r.log" 2>&1
    grep -o "'attention': '[^']*'.*'argmax_agreement_with_fp32': [0-9.e-]*\|vs_split_kv': [0-9.e-]*" \
        "$out/logits-vs-fp32-bs1-r.log"
    bench $with llama-8b 64,256 graphcap-graph bs64-256-r 150
    ;;
4)
    timeout 200 $py -m graphcap.testing -q --graphcap-json "$out/cuda-h200.json" \
        >"$out/conformance-r.log" 2>&1
    tail -3 "$out/conformance-r.log"
    bench $with llama-1b 64,256 graphcap-graph-compiled bs64-256-r 90
    ;;
esac
