#!/usr/bin/env bash
# H200 run AA (issue 11): the split-KV kernel's loads and split count, captures on cuBLASLt, and
# the figures, cold caches (after the runs, the variant loops became `variants` and the final
# part's benches and checks `issue11_figures` and `device_checks`, in device_env.sh; the same
# commands, the device tests' timeout 150 s instead of 130):
#   bash benchmarks/session_aa_h200.sh OUT loads    # commit b378ae1: span-bounded K/V loads
#   bash benchmarks/session_aa_h200.sh OUT splits   # commit 0dacdb1: programs per SM, block width
#   bash benchmarks/session_aa_h200.sh OUT blas     # tests; warps x stages; cuBLASLt products
#   bash benchmarks/session_aa_h200.sh OUT final    # issue 11's figures; HF ratio with --isolate
# "loads": the split-KV tests on the GPU; benchmarks/split_kv_tuning_h200.py's "loads" stage
# (the kernel alone in CUDA-graph replays); graphcap bench of the compiled step at batch 64 and
# 256 (benchmarks/bench_knobs.py) with split_kv.SPAN_LOADS=0 and 1, one process each.
# "splits": the tuning script's "splits" stage; the compiled step at batch 64 and 256 with
# split_kv's PROGRAMS_PER_SM / BLOCK_N as committed and changed, one process each.
# "blas": the split-KV and attention tests on the GPU; the tuning script's "warps" stage; the
# compiled step at batch 64 and 256 with cuBLAS (as committed) and cuBLASLt products
# (torch.backends.cuda.preferred_blas_library), one process each.
# "final": llama-8b batch 1 with HF static + compile, the default graph and the compiled step,
# each in its own process (graphcap bench --isolate; cold caches, first in the call), then in
# one process as runs U-Z took it; llama-8b 64 / 256 and llama-1b 1 / 64 / 256 compiled; the
# CUDA backend and device rollout tests (fp32 tokens of graph paths); the conformance suite;
# a profile of llama-8b's compiled step at batch 64; the compiled step with
# backend.CAPTURE_BLAS=none (torch's cuBLAS) at the sizes where
# cuBLASLt was not timed.
# One tarball comes back (run-aa-PART.tar), rewritten after each part.
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
session_part aa "$1" "$2"
if [[ $part == loads ]]; then
    timeout 120 $py -m pytest -q -rs -p no:cacheprovider backends/cuda/tests/test_split_kv.py \
        backends/cuda/tests/test_split_kv_cuda.py >"$work/split-kv-tests-aa.log" 2>&1
    tail -1 "$work/split-kv-tests-aa.log"
    (cd benchmarks && timeout 220 $py split_kv_tuning_h200.py "$work/split-kv-loads-aa.json" \
        loads >"$work/split-kv-loads-aa.log" 2>&1)
    tail -3 "$work/split-kv-loads-aa.log"
    keep
    variants llama-8b 64,256 70 off=split_kv.SPAN_LOADS=0 span=
    variants llama-1b 64 40 off=split_kv.SPAN_LOADS=0 span=
elif [[ $part == splits ]]; then
    (cd benchmarks && timeout 200 $py split_kv_tuning_h200.py "$work/split-kv-splits-aa.json" \
        splits >"$work/split-kv-splits-aa.log" 2>&1)
    tail -1 "$work/split-kv-splits-aa.log"
    keep
    variants llama-8b 64,256 70 now= pps2=split_kv.PROGRAMS_PER_SM=2 \
        pps2-b32=split_kv.PROGRAMS_PER_SM=2,split_kv.BLOCK_N=32
    variants llama-1b 64 40 now= pps2=split_kv.PROGRAMS_PER_SM=2
elif [[ $part == blas ]]; then
    timeout 150 $py -m pytest -q -rs -p no:cacheprovider backends/cuda/tests/test_split_kv.py \
        backends/cuda/tests/test_split_kv_cuda.py backends/cuda/tests/test_gqa_attention_cuda.py \
        >"$work/attention-tests-aa.log" 2>&1
    tail -1 "$work/attention-tests-aa.log"
    (cd benchmarks && timeout 150 $py split_kv_tuning_h200.py "$work/split-kv-warps-aa.json" \
        warps >"$work/split-kv-warps-aa.log" 2>&1)
    tail -1 "$work/split-kv-warps-aa.log"
    keep
    variants llama-8b 64,256 70 cublas= cublaslt=blas=cublaslt
elif [[ $part == final ]]; then
    issue11_figures
    timeout 100 $py -m pytest -q -rs -p no:cacheprovider backends/cuda/tests/test_cuda_backend.py \
        >"$work/backend-tests-aa.log" 2>&1
    tail -1 "$work/backend-tests-aa.log"
    device_checks llama-8b:bf16:64 bs64
    keep
    GRAPHCAP_KNOBS=backend.CAPTURE_BLAS=none step_bench "$work" benchmarks/bench_knobs.py \
        llama-1b 64,256 graphcap-graph-compiled aa-cublas 40
    grep -E '^graphcap-graph-compiled|Error' "$work/bench-llama-1b-aa-cublas.txt"
fi
keep
