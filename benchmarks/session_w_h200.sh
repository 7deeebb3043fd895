#!/usr/bin/env bash
# H200 run W (issue 11): the compiled sampler (graphcap.rollout.regions.compiled_sampler), in
# one call, cold caches: the device tests of compiled captures (fp32 tokens equal eager's,
# sampling included); the compiled step with and without it (benchmarks/bench_knobs.py,
# regions.COMPILE_SAMPLER=0), llama-8b and llama-1b at batch 1 and 64, as in runs L-U; where the
# split-KV kernel's cold first launch spends its time. One tarball comes back (run-w.tar).
#   bash benchmarks/session_w_h200.sh OUT
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
cold_compile_caches
mkdir -p /tmp/w
timeout 240 $py -m pytest -q -rs -m device -p no:cacheprovider tests/test_device_rollout.py \
    -k "compiled or sampling or continuous" >/tmp/w/device-tests-w.log 2>&1
tail -1 /tmp/w/device-tests-w.log
TRITON_CACHE_DIR=$(mktemp -d) timeout 60 $py benchmarks/triton_cold_h200.py \
    >/tmp/w/triton-cold-w.log 2>&1
head -3 /tmp/w/triton-cold-w.log
for variant in eager-sampler=graphcap.rollout.regions.COMPILE_SAMPLER=0 compiled-sampler=; do
    for case in llama-8b llama-1b; do
        GRAPHCAP_KNOBS=${variant#*=} step_bench /tmp/w benchmarks/bench_knobs.py "$case" 1,64 \
            graphcap-graph-compiled "w-${variant%%=*}" 110
        echo "${variant%%=*} $case:"
        grep -E '^graphcap-graph-compiled|Error' "/tmp/w/bench-$case-w-${variant%%=*}.txt"
    done
done
tar -cf "$out/run-w.tar" -C /tmp w
