#!/usr/bin/env bash
# graphcap bench on one H200: the runs behind docs/benchmarks.md's results section.
#
#   bash benchmarks/h200.sh RESULTS_DIR
#
# Expects the machine's own python3 with torch 2.11 + transformers 5.17, and graphcap installed
# with:  pip install --no-build-isolation --no-deps -e . ./backends/cuda
# No network is needed (all models are random-weight presets).
#
# Time: designed to finish in under 8 minutes. Each run gets a sweep budget (--budget-s); a
# (mode, batch size) pair not started within it is reported as "skipped" in the JSON, so the
# script cannot overrun by more than one mode's duration. Compiling modes (their cold first
# call takes tens of seconds) run at batch size 1 only.
#
# Compilation caches go to a fresh temporary directory, so "first call" figures are cold
# compiles on every run of this script, not hits in a cache left by an earlier run.
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: $0 RESULTS_DIR" >&2
    exit 2
fi
OUT=$1
mkdir -p "$OUT"
cd "$(dirname "$0")/.."

export GRAPHCAP_BACKEND=cuda
export HF_HUB_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
CACHE=$(mktemp -d)
trap 'rm -rf "$CACHE"' EXIT
export TORCHINDUCTOR_CACHE_DIR=$CACHE/inductor
export TRITON_CACHE_DIR=$CACHE/triton

START=$(date +%s)
LIMIT=450  # seconds for the whole script; budgets below are carved out of it

PLOT=()
if python3 -c "import matplotlib" 2>/dev/null; then
    PLOT=(yes)
else
    echo "matplotlib not installed: writing JSON only; plot later with" >&2
    echo "  python3 benchmarks/plot_report.py RESULTS_DIR/<run>.json <run>.png" >&2
fi

remaining() { echo $((LIMIT - ($(date +%s) - START))); }

# bench NAME SWEEP_BUDGET_S ARGS...: one run, JSON (and PNG) named NAME, log next to them.
bench() {
    local name=$1 budget=$2
    shift 2
    local left
    left=$(remaining)
    # Keep 25 s for the run's start-up (CUDA context, building the model) and its last mode.
    if ((budget > left - 25)); then budget=$((left - 25)); fi
    if ((budget < 10)); then
        echo "== $name: skipped, only ${left}s of the script's ${LIMIT}s left" >&2
        return 0
    fi
    echo "== $name (sweep budget ${budget}s, $(remaining)s of the script left)" >&2
    if ! python3 -m graphcap.bench --budget-s "$budget" --json "$OUT/$name.json" \
        "$@" 2> >(tee "$OUT/$name.log" >&2) | tee "$OUT/$name.txt"; then
        echo "== $name FAILED (see $OUT/$name.log); continuing" >&2
        FAILED=$((FAILED + 1))
    elif [[ ${#PLOT[@]} -gt 0 && $name == *sweep* ]]; then
        python3 benchmarks/plot_report.py "$OUT/$name.json" "$OUT/$name.png"
    fi
}
FAILED=0

# 1. GPT-2 medium shape, fp16: every mode at bs 1, 32 + 32 tokens (short and launch-bound).
bench gpt2-medium-bs1 70 --model gpt2-medium --dtype fp16 \
    --batch-sizes 1 --prompt-len 32 --new-tokens 32 --warmup 1 --repeats 5

# 2. Llama-3.2-1B shape, bf16: every mode at bs 1 (128 + 128 tokens), the modes that do not
#    compile at bs 8/32/64, then the RL loop (generate -> SGD step in place -> generate) at bs 8.
bench llama-1b-sweep 140 --model llama-1b --dtype bf16 \
    --batch-sizes 1,8,32,64 --compile-batch-sizes 1 --prompt-len 128 --new-tokens 128 \
    --warmup 0 --repeats 3 --rl-loop 3 --rl-batch-size 8

# 3. Llama-3-8B shape, bf16: the same sweep without the RL loop, in whatever time is left.
bench llama-8b-sweep "$(remaining)" --model llama-8b --dtype bf16 \
    --batch-sizes 1,8,32,64 --compile-batch-sizes 1 --prompt-len 128 --new-tokens 128 \
    --warmup 0 --repeats 3

echo "done in $(($(date +%s) - START))s; results in $OUT; failed runs: $FAILED" >&2
exit $((FAILED > 0))
