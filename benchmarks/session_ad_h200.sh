#!/usr/bin/env bash
# H200 run AD (issue 11): does the split-KV kernel pay at a few rows, and what does Triton cost
# the default mode's first call in a fresh process, cold caches:
#   bash benchmarks/session_ad_h200.sh OUT probe
#   bash benchmarks/session_ad_h200.sh OUT rows     # the kernel's launch at a few rows
#   bash benchmarks/session_ad_h200.sh OUT ab       # the new launch rule in the step
#   bash benchmarks/session_ad_h200.sh OUT first    # the default mode's first call, profiled
#   bash benchmarks/session_ad_h200.sh OUT combine  # the combine's loads, a few chunks at once
# "probe": the kernel against SDPA with enable_gqa alone at 1-128 rows
# (benchmarks/attention_crossover_h200.py); then llama-8b batch 1, each mode in its own process
# (graphcap bench --isolate), the default graph and the compiled step, once with SDPA as the
# captured attention (--graph-attention graphcap_gqa_sdpa) and once as committed (auto: the
# split-KV kernel), each invocation with its own empty compile caches.
# "rows": benchmarks/split_kv_few_rows_h200.py (every block width and chunk count at 1-32 rows).
# "ab": the split-KV tests on the GPU; then the compiled step at 8-32 rows, llama-8b and
# llama-1b, with the launch rule as committed and as before it, from .old (the tree before the
# change: git archive of its commit, sent with the run's carry), each tree from its own folder
# and environment, cold caches for each.
# "first": benchmarks/first_call_profile_h200.py with the bench's warm-up forward, llama-8b
# batch 1, SDPA as the captured attention, then the split-KV kernel, each in a fresh process
# with empty compile caches; then the split-KV kernel's bf16 accuracy (16 rows among the cases)
# and launch rule, the device rollout tests, the conformance suite and a profile at 16 rows.
# "combine": the split-KV tests on the GPU, the few-rows sweep again, then llama-8b's compiled
# step at 1 and 4 rows with the combine as committed and as before it (.old, as in "ab"). It
# ran at commit a35b491 (.old: eac353d); that combine was slower on llama-8b and was reverted.
# The helpers split_kv_tests and old_new were drawn out of the parts after they ran (the same
# commands). One tarball comes back (run-ad-PART.tar), rewritten after each part.
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
session_part ad "$1" "$2"
# split_kv_tests NAME TIMEOUT [PYTEST ARGS]: the kernel's tests on the GPU into $work/NAME.log.
split_kv_tests() {
    timeout "$2" $py -m pytest -q -rs -p no:cacheprovider backends/cuda/tests/test_split_kv.py \
        backends/cuda/tests/test_split_kv_cuda.py "${@:3}" >"$work/$1.log" 2>&1
    tail -1 "$work/$1.log"
    keep
}
# old_new TAG MODEL:SIZES:BUDGET...: the compiled step of each model at SIZES from this tree
# ("new") and from .old ("old": the tree before the change, sent with the run's carry), each
# from its own folder and environment with empty compile caches, into
# $work/bench-MODEL-TAG-{new,old}.{json,txt}.
old_new() {
    local tag=$1 tree dir
    make_env /tmp/env-old "$PWD/.old"
    for tree in new old; do
        dir=$PWD && [[ $tree == old ]] && dir=$PWD/.old
        (cd "$dir" && py=/tmp/env-$tree/bin/python && cold_compile_caches &&
            for case in "${@:2}"; do
                IFS=: read -r model sizes budget <<<"$case"
                step_bench "$work" -mgraphcap.bench "$model" "$sizes" \
                    graphcap-graph-compiled "$tag-$tree" "$budget"
            done)
        echo "$tree:"
        grep -hE '^graphcap-graph-compiled' "$work"/bench-*-"$tag-$tree".txt
        keep
    done
}
if [[ $part == probe ]]; then
    (cd benchmarks && timeout 150 $py attention_crossover_h200.py \
        "$work/attention-crossover-ad.json" >"$work/attention-crossover-ad.log" 2>&1)
    tail -2 "$work/attention-crossover-ad.log"
    keep
    for attention in graphcap_gqa_sdpa auto; do
        cold_compile_caches
        timeout 200 $py -m graphcap.bench --model llama-8b --batch-sizes 1 --prompt-len 128 \
            --new-tokens 512 --repeats 3 --warmup 1 --fuse-projections --isolate \
            --modes graphcap-graph,graphcap-graph-compiled --graph-attention $attention \
            --json "$work/bench-llama-8b-bs1-$attention.json" \
            >"$work/bench-llama-8b-bs1-$attention.txt" 2>&1
        echo "$attention:"
        grep -E '^(graphcap|hf)-' "$work/bench-llama-8b-bs1-$attention.txt"
        keep
    done
elif [[ $part == rows ]]; then
    (cd benchmarks && timeout 400 $py split_kv_few_rows_h200.py \
        "$work/split-kv-few-rows-ad.json" >"$work/split-kv-few-rows-ad.log" 2>&1)
    tail -40 "$work/split-kv-few-rows-ad.log"
elif [[ $part == ab ]]; then
    split_kv_tests split-kv-tests-ad 150
    old_new ad llama-8b:8,16,32:160 llama-1b:8,16,32:90
elif [[ $part == first ]]; then
    for attention in graphcap_gqa_sdpa auto; do
        cold_compile_caches
        timeout 120 $py benchmarks/first_call_profile_h200.py \
            "$work/first-call-profile-ad-$attention.txt" --attention $attention --warm-forward \
            >"$work/first-call-profile-ad-$attention.log" 2>&1
        grep -E '^call' "$work/first-call-profile-ad-$attention.log" | cut -c1-600
        keep
    done
    split_kv_tests split-kv-bf16-ad 90 -k "bf16 or one_wave"
    device_checks llama-8b:bf16:16 bs16
elif [[ $part == combine ]]; then
    split_kv_tests split-kv-tests-combine 100
    (cd benchmarks && timeout 120 $py split_kv_few_rows_h200.py \
        "$work/split-kv-few-rows-combine.json" >"$work/split-kv-few-rows-combine.log" 2>&1)
    grep -E 'bs=(1|4|8):' "$work/split-kv-few-rows-combine.log" | head -20
    keep
    old_new combine llama-8b:1,4:70
fi
keep
