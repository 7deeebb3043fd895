#!/usr/bin/env bash
# H200 run AC (issue 11): the norm's row in one load at batch 1, the GEMMs' residual add in
# cuBLAS and the split-KV kernel's blocks at batch 256, then the figures, cold caches:
#   bash benchmarks/session_ac_h200.sh OUT probe    # tests; the A/Bs
#   bash benchmarks/session_ac_h200.sh OUT final    # issue 11's figures
#   bash benchmarks/session_ac_h200.sh OUT checks   # device tests, conformance, a profile
#   bash benchmarks/session_ac_h200.sh OUT persist  # the split-KV kernel's persistent form
# "probe": the kernel and pass tests of the changed forms on the GPU; llama-8b's compiled step,
# one process per variant: batch 1 with the norm's row read in one load (as committed) and
# block by block (gemv.NORM_ONE_LOAD=0); batch 64 and 256 with the residual add after the down
# projection in cuBLAS's addmm (as committed) and not (epilogues.ADDMM_RESIDUALS=0); batch 256
# with 16 KB split-KV blocks, and with 2 warps and 3 stages (run AA's sweep's best there). It
# ran at commit 5a18d49: the addmm rewrite did not pay and was removed, so its knob is gone.
# "final": issue11_figures (device_env.sh). "checks": device_checks with a profile of llama-8b
# at batch 256, then batch 256 with 2 warps and 3 stages again (the probe's variant stopped at
# bench_knobs.py refusing a knob whose default is None) and as committed, one process each.
# "persist": the split-KV tests on the GPU (the persistent form's among them, on a device
# pretended to have one multiprocessor), the kernel alone with and without the persistent form
# (benchmarks/split_kv_persistent_h200.py), and the compiled step of llama-8b and llama-1b at
# batch 256 with it (2 programs a multiprocessor, as committed) and without, one process each.
# It ran at commit 0b018bd; the persistent form was slower and was removed, so its knob is gone.
# One tarball comes back (run-ac-PART.tar), rewritten after each part.
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
session_part ac "$1" "$2"
if [[ $part == probe ]]; then
    timeout 120 $py -m pytest -q -rs -p no:cacheprovider backends/cuda/tests/test_epilogues.py \
        -k "norm or gemm" >"$work/kernel-tests-ac.log" 2>&1
    tail -1 "$work/kernel-tests-ac.log"
    keep
    variants llama-8b 1 40 row= blocks=gemv.NORM_ONE_LOAD=0
    variants llama-8b 64,256 70 addmm= off=epilogues.ADDMM_RESIDUALS=0
    variants llama-8b 256 60 bb16=split_kv.BLOCK_BYTES=16384 \
        w2=split_kv.NUM_WARPS=2,split_kv.NUM_STAGES=3
elif [[ $part == final ]]; then
    issue11_figures
elif [[ $part == checks ]]; then
    device_checks llama-8b:bf16:256 bs256
    keep
    variants llama-8b 256 60 w2=split_kv.NUM_WARPS=2,split_kv.NUM_STAGES=3 now=
elif [[ $part == persist ]]; then
    timeout 120 $py -m pytest -q -rs -p no:cacheprovider backends/cuda/tests/test_split_kv.py \
        backends/cuda/tests/test_split_kv_cuda.py >"$work/split-kv-tests-ac.log" 2>&1
    tail -1 "$work/split-kv-tests-ac.log"
    keep
    (cd benchmarks && timeout 120 $py split_kv_persistent_h200.py \
        "$work/split-kv-persistent-ac.json" >"$work/split-kv-persistent-ac.log" 2>&1)
    tail -3 "$work/split-kv-persistent-ac.log"
    keep
    variants llama-8b 256 60 persistent= off=split_kv.PERSISTENT_PER_SM=0
    variants llama-1b 256 40 persistent= off=split_kv.PERSISTENT_PER_SM=0
fi
keep
