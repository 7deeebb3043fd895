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
# "again": the final part's isolated batch-1 comparison once more (it ran on the same machine),
# HF and the compiled step only (HF's step has varied 7.0-8.4 ms between runs).
# One tarball comes back (run-ab-PART.tar), rewritten after each part.
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
session_part ab "$1" "$2"
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
    issue11_figures
elif [[ $part == again ]]; then
    isolated_bench hf-static-compile,graphcap-graph-compiled again-ab 200
elif [[ $part == checks ]]; then
    device_checks llama-8b:bf16:1 bs1
fi
keep
