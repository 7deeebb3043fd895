#!/usr/bin/env bash
# One H200 call after the per-call scan: bench before/after again (graph modes), the host-overhead
# profile, the sleep and GRPO device checks, and the decode-kernel measurements (issue 11).
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
for tree in old new; do
    dir=$([[ $tree == old ]] && echo .old || echo .)
    make_env /tmp/env-$tree $dir
    (cd $dir && /tmp/env-$tree/bin/python -m graphcap.bench --model gpt2-medium --dtype fp16 \
        --batch-sizes 1 --prompt-len 32 --new-tokens 32 --warmup 1 --repeats 7 \
        --modes graphcap-graph --json /tmp/bench-gpt2-medium-$tree.json) | tail -4
    (cd $dir && /tmp/env-$tree/bin/python -m graphcap.bench --model llama-8b --dtype bf16 \
        --batch-sizes 1 --prompt-len 128 --new-tokens 128 --warmup 1 --repeats 3 \
        --modes graphcap-graph --json /tmp/bench-llama-8b-$tree.json) | tail -4
done
tar -czf "$out/bench-before-after.tgz" -C /tmp bench-gpt2-medium-old.json bench-gpt2-medium-new.json \
    bench-llama-8b-old.json bench-llama-8b-new.json
py=/tmp/env-new/bin/python
$py benchmarks/host_overhead_h200.py >"$out/host-overhead.log" 2>&1; head -2 "$out/host-overhead.log"
$py -m pytest -q -rs -s -m device tests/test_device_rollout.py -k "sleep" tests/test_grpo_example.py \
    -p no:cacheprovider >"$out/sleep-grpo-device.log" 2>&1; tail -3 "$out/sleep-grpo-device.log"
$py examples/grpo_loop.py --sleep >>"$out/sleep-grpo-device.log" 2>&1; tail -3 "$out/sleep-grpo-device.log"
$py benchmarks/decode_kernels_h200.py "$out/decode-kernels.json" >"$out/decode-kernels.log" 2>&1
tail -40 "$out/decode-kernels.log"
