#!/usr/bin/env bash
# capture-timers.py's runs (OUT: where the files go): llama-1b from empty caches, then warm
# processes from the caches it left, under the timers, as a program calls (no collection before
# the clock) and as graphcap bench calls (garbage collected and the allocator's cache emptied
# first), twice each; then graphcap bench's warm first call from the same caches. Run after
# benchmarks/h200.sh made its environment.
set -uo pipefail
OUT=$1
py=${GRAPHCAP_ENV:-/tmp/graphcap-h200-env}/bin/python
here=benchmarks/results/first-call
export GRAPHCAP_BACKEND=cuda HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=${GRAPHCAP_ENV:-/tmp/graphcap-h200-env}/pycache
C=$(mktemp -d)
export TORCHINDUCTOR_CACHE_DIR=$C/inductor TRITON_CACHE_DIR=$C/triton
for run in cold warm-1 warm-collect-first-1 warm-2 warm-collect-first-2; do
    extra=()
    [[ $run == *collect-first* ]] && extra=(--collect-first)
    "$py" $here/capture-timers.py "$OUT/capture-timers-llama-1b-$run.json" \
        benchmarks/first_call_profile.py "$OUT/capture-timers-llama-1b-$run.txt" \
        --model llama-1b --new-tokens 128 --warm-forward --no-profile --compile-cache "$C/graphcap" \
        "${extra[@]}" >"$OUT/capture-timers-llama-1b-$run.log" 2>&1
    echo "$run: $(grep -o 'call 1: [0-9.]* s' "$OUT/capture-timers-llama-1b-$run.log")"
    tail -1 "$OUT/capture-timers-llama-1b-$run.log"
done
"$py" -m graphcap.bench --model llama-1b --batch-sizes 1 --dtype bf16 --prompt-len 128 \
    --new-tokens 128 --repeats 1 --warmup 0 --isolate --modes graphcap-graph \
    --compile-cache "$C/graphcap" --json "$OUT/capture-timers-bench-llama-1b-warm.json" \
    >"$OUT/capture-timers-bench-llama-1b-warm.txt" 2>&1
grep -A2 "first calls" "$OUT/capture-timers-bench-llama-1b-warm.txt"
