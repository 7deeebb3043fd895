#!/usr/bin/env bash
# H200 run AB (issue 11): where the default mode's first call goes, GEMM autotuning at batch 256,
# and the figures, cold caches:
#   bash benchmarks/session_ab_h200.sh OUT probe    # first-call profile; autotuned GEMMs
#   bash benchmarks/session_ab_h200.sh OUT norms    # tests; the norm in the one-row product
#   bash benchmarks/session_ab_h200.sh OUT final    # issue 11's figures, tests, conformance
# "probe": benchmarks/first_call_profile_h200.py (llama-8b batch 1, a fresh process, first in the
# call); llama-8b's compiled step at batch 256 as committed and with inductor's GEMM autotuning
# (max_autotune_gemm, persistent TMA templates among the choices), one process each.
# "norms": the first-call profile again (graph capture on; the probe part's ran eagerly); the
# one-row kernel and epilogue-pass tests and the backend's on the GPU; the compiled batch-1
# step of llama-8b and llama-1b with the norm and the add after attention moved into the
# gate/up product (as committed) and not (epilogues.FOLD_NORMS=0), one process each.
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
fi
keep
