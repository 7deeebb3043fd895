#!/usr/bin/env bash
# H200 run AB (issue 11): where the default mode's first call goes, GEMM autotuning at batch 256,
# and the figures, cold caches:
#   bash benchmarks/session_ab_h200.sh OUT probe    # first-call profile; autotuned GEMMs
#   bash benchmarks/session_ab_h200.sh OUT final    # issue 11's figures, tests, conformance
# "probe": benchmarks/first_call_profile_h200.py (llama-8b batch 1, a fresh process, first in the
# call); llama-8b's compiled step at batch 256 as committed and with inductor's GEMM autotuning
# (max_autotune_gemm, persistent TMA templates among the choices), one process each.
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
fi
keep
