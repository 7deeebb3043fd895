#!/usr/bin/env bash
# H200 run AB (issue 11): where the default mode's first call goes, GEMM autotuning at batch 256,
# and the figures, cold caches:
#   bash benchmarks/session_ab_h200.sh OUT probe    # first-call profile; autotuned GEMMs
#   bash benchmarks/session_ab_h200.sh OUT norms    # tests; the norm in the one-row product
#   bash benchmarks/session_ab_h200.sh OUT final    # issue 11's figures
#   bash benchmarks/session_ab_h200.sh OUT checks   # device tests, conformance, a profile
#   bash benchmarks/session_ab_h200.sh OUT again    # HF's and the compiled batch-1 step again
# "probe": benchmarks/first_call_profile_h200.py (llama-8b batch 1, a fresh process, first in the
# call); llama-8b's compiled step at batch 256 as committed and with inductor's GEMM autotuning
# (max_autotune_gemm, persistent TMA templates among the choices), one process each.
# "norms": the first-call profile again (graph capture on; the probe part's ran eagerly); the
# one-row kernel and epilogue-pass tests and the backend's on the GPU; the compiled batch-1
# step of llama-8b and llama-1b with the norm and the add after attention moved into the
# gate/up product (as committed) and not (epilogues.FOLD_NORMS=0), one process each.
# "final": llama-8b batch 1 with HF static + compile, the default graph and the compiled step,
# each in its own process (graphcap bench --isolate; cold caches, first in the call); llama-8b
# 64 / 256 and llama-1b 1 / 64 / 256 compiled.
# "checks": the device rollout tests (fp32 tokens of graph paths), the conformance suite, and
# a profile of llama-8b's compiled step at batch 1.
# "again": the final part's isolated batch-1 comparison once more on another machine, HF and
# the compiled step only (HF's step has varied 7.0-8.4 ms between runs).
# One tarball comes back (run-ab-PART.tar), rewritten after each part.
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
session_part ab "$2"
# variants MODEL SIZES BUDGET NAME=KNOBS...: the compiled step through bench_knobs.py, one
# process per variant (KNOBS as GRAPHCAP_KNOBS; empty: as committed), its rows shown.
variants() {
    local model=$1 sizes=$2 budget=$3 variant
    for variant in "${@:4}"; do
        GRAPHCAP_KNOBS=${variant#*=} step_bench "$work" benchmarks/bench_knobs.py "$model" \
            "$sizes" graphcap-graph-compiled "ab-${variant%%=*}" "$budget"
        echo "${variant%%=*}:"
        grep -E '^graphcap-graph-compiled|Error' "$work/bench-$model-ab-${variant%%=*}.txt"
        keep
    done
}
if [[ $part == probe ]]; then
    timeout 150 $py benchmarks/first_call_profile_h200.py "$work/first-call-profile-ab.txt" \
        >"$work/first-call-profile-ab.log" 2>&1
    grep -E '^call' "$work/first-call-profile-ab.log"
    keep
    variants llama-8b 256 60 now=
    variants llama-8b 256 220 \
        autotune=inductor.max_autotune_gemm=1,inductor.triton.enable_persistent_tma_matmul=1
elif [[ $part == norms ]]; then
    timeout 150 $py benchmarks/first_call_profile_h200.py "$work/first-call-profile-ab.txt" \
        >"$work/first-call-profile-ab.log" 2>&1
    grep -E '^call' "$work/first-call-profile-ab.log" | cut -c1-400
    keep
    timeout 200 $py -m pytest -q -rs -p no:cacheprovider backends/cuda/tests/test_epilogues.py \
        backends/cuda/tests/test_gemv.py backends/cuda/tests/test_cuda_backend.py \
        >"$work/kernel-tests-ab.log" 2>&1
    tail -1 "$work/kernel-tests-ab.log"
    keep
    variants llama-8b 1 40 norms= off=epilogues.FOLD_NORMS=0 norms2=
    variants llama-1b 1 30 norms= off=epilogues.FOLD_NORMS=0
elif [[ $part == final ]]; then
    timeout 240 $py -m graphcap.bench --model llama-8b --batch-sizes 1 --prompt-len 128 \
        --new-tokens 512 --repeats 3 --warmup 1 --fuse-projections --isolate \
        --modes hf-static-compile,graphcap-graph,graphcap-graph-compiled \
        --json "$work/bench-llama-8b-bs1-isolated-ab.json" >"$work/bench-llama-8b-bs1-isolated-ab.txt" 2>&1
    grep -E '^(graphcap|hf)-' "$work/bench-llama-8b-bs1-isolated-ab.txt"
    keep
    shown_bench "$work" llama-8b 64,256 graphcap-graph-compiled bs64-256-ab 90
    keep
    shown_bench "$work" llama-1b 1,64,256 graphcap-graph-compiled bs1-64-256-ab 70
elif [[ $part == again ]]; then
    timeout 200 $py -m graphcap.bench --model llama-8b --batch-sizes 1 --prompt-len 128 \
        --new-tokens 512 --repeats 3 --warmup 1 --fuse-projections --isolate \
        --modes hf-static-compile,graphcap-graph-compiled \
        --json "$work/bench-llama-8b-bs1-again-ab.json" >"$work/bench-llama-8b-bs1-again-ab.txt" 2>&1
    grep -E '^(graphcap|hf)-' "$work/bench-llama-8b-bs1-again-ab.txt"
elif [[ $part == checks ]]; then
    timeout 150 $py -m pytest -q -rs -m device -p no:cacheprovider tests/test_device_rollout.py \
        -k "greedy_graph_equals or compiled or continuous or per_position" \
        >"$work/device-tests-ab.log" 2>&1
    tail -1 "$work/device-tests-ab.log"
    keep
    timeout 100 $py -m graphcap.testing -q --graphcap-json "$work/cuda-h200.json" \
        >"$work/conformance-ab.log" 2>&1
    tail -1 "$work/conformance-ab.log"
    keep
    timeout 70 $py benchmarks/profile_decode.py "$work/profile-decode-ab-bs1.json" --fast \
        --cases llama-8b:bf16:1 --new-tokens 256 >"$work/profile-ab.log" 2>&1
    grep -E '"(kernels_per_step|device_ms_per_step|decode_ms_per_step_wall)"' "$work/profile-ab.log"
fi
keep
