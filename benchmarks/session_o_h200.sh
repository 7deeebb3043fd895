#!/usr/bin/env bash
# H200 run O (issue 11): the step after run N's changes (K/V writes compiled into one kernel,
# the decoder stack's final norm and rotary embedding compiled, the split-KV span scan in one
# wide read), measured as in run L: graphcap bench, bf16, 128 + 512 tokens, --fuse-projections,
# cold compile caches, HF static cache + compile at batch 1 in the same run.
#   bash benchmarks/session_o_h200.sh OUT 1   device tests; llama-8b batch 1 (with HF)
#   bash benchmarks/session_o_h200.sh OUT 2   the K/V write alone; llama-8b batch 64, 256;
#                                              llama-1b batch 1 (with HF)
#   bash benchmarks/session_o_h200.sh OUT 3   llama-1b batch 64, 256; bf16 teacher-forced logits
#                                              of the speed options; profile of llama-8b batch 1
#   bash benchmarks/session_o_h200.sh OUT 4   batch 1 of both models again (with HF), the eager
#                                              K/V write back to scatters (parts 1-2 timed the
#                                              default mode with index_put_, 2x slower eagerly)
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
cold_compile_caches

bench() {  # MODEL SIZES MODES TAG BUDGET
    step_bench "$out" -mgraphcap.bench "$@"
    tail -6 "$out/bench-$1-$4.txt"
}

case $2 in
1)
    timeout 170 $py -m pytest -q -rs -m device tests backends/cuda/tests >"$out/device-tests-o.log" 2>&1
    tail -3 "$out/device-tests-o.log"
    bench llama-8b 1 hf-static-compile,graphcap-graph,graphcap-graph-compiled bs1-o 150
    ;;
2)
    timeout 60 $py benchmarks/kv_write_h200.py "$out/kv-write.json" >"$out/kv-write.log" 2>&1
    tail -3 "$out/kv-write.log"
    bench llama-8b 64,256 graphcap-graph,graphcap-graph-compiled bs64-256-o 170
    bench llama-1b 1 hf-static-compile,graphcap-graph,graphcap-graph-compiled bs1-o 90
    ;;
3)
    bench llama-1b 64,256 graphcap-graph,graphcap-graph-compiled bs64-256-o 90
    timeout 150 $py benchmarks/logits_vs_fp32_h200.py "$out/logits-vs-fp32-o.json" \
        >"$out/logits-vs-fp32-o.log" 2>&1
    grep -o "'attention': '[^']*'.*'decode_max_abs_diff_vs_fp32': [0-9.e-]*\|vs_split_kv': [0-9.e-]*" \
        "$out/logits-vs-fp32-o.log"
    timeout 90 $py benchmarks/profile_decode.py "$out/profile-decode-o.json" --fast \
        --cases llama-8b:bf16:1 --new-tokens 256 >"$out/profile-o.log" 2>&1
    grep -E '"(kernels_per_step|device_ms_per_step|decode_ms_per_step_wall)"|gemm|other|attention"' \
        "$out/profile-o.log" | head -10
    ;;
4)  # after the eager write went back to two scatters (kv-write.json): the default mode again
    bench llama-8b 1 hf-static-compile,graphcap-graph,graphcap-graph-compiled bs1-o4 150
    bench llama-1b 1 hf-static-compile,graphcap-graph,graphcap-graph-compiled bs1-o4 90
    ;;
esac
