#!/usr/bin/env bash
# H200 run Z (issue 11): the one-row product's epilogues (graphcap_cuda.epilogues: a gated MLP's
# activation and the residual add after it run inside the product's kernel) and the host's part
# in the compiled step, cold caches:
#   bash benchmarks/session_z_h200.sh OUT ab      # tests; the step with and without; host stalls
#   bash benchmarks/session_z_h200.sh OUT ab2 BASE # the same after the kernel's fixes, and the
#                                                  # products against BASE's kernel (a gemv.py)
#   bash benchmarks/session_z_h200.sh OUT final   # the figures of issue 11, as run X took them
# "ab": the kernel and pass tests on the GPU (bf16 included) and the device tests of compiled
# captures (fp32 tokens equal eager's); graphcap bench of the compiled step at batch 1
# (benchmarks/bench_knobs.py) with backend.EPILOGUES=0 and as committed, one process each;
# then benchmarks/host_stalls_h200.py (llama-8b after HF static cache + compile, one process).
# "final": session_x_h200.sh's final calls. One tarball comes back (run-z-PART.tar).
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
cold_compile_caches
part=$2
work=/tmp/z-$part
mkdir -p "$work"
keep() { tar -cf "$out/run-z-$part.tar" -C /tmp "z-$part"; }
# The kernel and pass tests on the GPU, and the device tests of compiled captures.
tests() {
    timeout 150 $py -m pytest -q -rs -p no:cacheprovider backends/cuda/tests/test_gemv.py \
        backends/cuda/tests/test_epilogues.py >"$work/kernel-tests-z.log" 2>&1
    tail -1 "$work/kernel-tests-z.log"
    timeout 150 $py -m pytest -q -rs -m device -p no:cacheprovider tests/test_device_rollout.py \
        -k compiled >"$work/device-tests-z.log" 2>&1
    tail -1 "$work/device-tests-z.log"
}
# The compiled step at batch 1 without the epilogue pass and with it, one process each.
with_and_without() {
    for variant in off=backend.EPILOGUES=0 now=; do
        for model in llama-8b llama-1b; do
            GRAPHCAP_KNOBS=${variant#*=} step_bench "$work" benchmarks/bench_knobs.py "$model" \
                1 graphcap-graph-compiled "z-${variant%%=*}" 40
            echo "${variant%%=*} $model:"
            grep -E '^graphcap-graph-compiled|Error' "$work/bench-$model-z-${variant%%=*}.txt"
        done
    done
}
if [[ $2 == ab ]]; then
    tests
    with_and_without
    timeout 200 $py benchmarks/host_stalls_h200.py "$work/host-stalls-z.json" \
        >"$work/host-stalls-z.log" 2>&1
    tail -4 "$work/host-stalls-z.log"
elif [[ $2 == ab2 ]]; then
    tests
    for model in llama-8b llama-1b; do
        timeout 150 $py benchmarks/gemv_ab_h200.py "$work/gemv-ab-$model.json" "$3" \
            --model "$model" 2>&1 | grep -E '"(cublas|base|tree|tree_fused|products_plain)"'
    done
    with_and_without
else  # the tarball is rewritten after each part, so a call cut short keeps what ran
    shown_bench "$work" llama-8b 1 hf-static-compile,graphcap-graph,graphcap-graph-compiled bs1-z 150
    keep
    timeout 90 $py benchmarks/profile_decode.py "$work/profile-decode-z.json" --fast \
        --cases llama-8b:bf16:1 --new-tokens 256 >"$work/profile-z.log" 2>&1
    grep -E '"(kernels_per_step|device_ms_per_step|decode_ms_per_step_wall)"' "$work/profile-z.log"
    keep
    shown_bench "$work" llama-8b 64,256 graphcap-graph-compiled bs64-256-z 90
    keep
    shown_bench "$work" llama-1b 1,64,256 graphcap-graph-compiled bs1-64-256-z 70
    keep
    timeout 120 $py -m graphcap.testing -q --graphcap-json "$work/cuda-h200.json" \
        >"$work/conformance-z.log" 2>&1
    tail -1 "$work/conformance-z.log"
fi
keep
