#!/usr/bin/env bash
# H200 run S (issue 11): compile=True compiles each decoder layer with its attention left out
# (two frames every layer shares, so the residual add after attention fuses with the next norm),
# against the tree before it (run R's code) in the same call:
#   git archive d49af8c | tar -x -C .old      # here, before sending the tree
#   bash benchmarks/session_s_h200.sh .old OUT [benches]   (benches: llama-1b only, no tests)
# The first call ran the old tree's bench from this tree's directory, so it imported this tree's
# graphcap (`python -m` puts the working directory first): its "old" figures are not the old code.
# Device tests on this tree; then graphcap bench (as in run R, compiled mode only) on each tree:
# llama-8b batch 1, llama-1b batch 1 and 64.
set -uo pipefail
old=$(cd "$1" && pwd)
out=$(mkdir -p "$2" && cd "$2" && pwd)
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
make_env /tmp/env-old "$old"
cold_compile_caches
if [[ ${3:-} != benches ]]; then
    timeout 150 $py -m pytest -q -rs -m device tests backends/cuda/tests \
        >"$out/device-tests-s.log" 2>&1
    tail -1 "$out/device-tests-s.log"
fi
models=$([[ ${3:-} == benches ]] && echo llama-1b || echo "llama-8b llama-1b")
for model in $models; do
    sizes=$([[ $model == llama-8b ]] && echo 1 || echo 1,64)
    for tree in old new; do
        dir=$([[ $tree == old ]] && echo "$old" || echo "$PWD")
        # run from the tree: `python -m` puts the working directory first on sys.path
        (cd "$dir" && timeout 120 /tmp/env-$tree/bin/python -m graphcap.bench --model $model \
            --batch-sizes $sizes --compile-batch-sizes $sizes --prompt-len 128 \
            --new-tokens 512 --repeats 3 --warmup 1 --modes graphcap-graph-compiled \
            --fuse-projections --budget-s 60 --json "$out/bench-$model-s-$tree.json" \
            >"$out/bench-$model-s-$tree.txt" 2>&1)
        tail -3 "$out/bench-$model-s-$tree.txt" | head -2
    done
done
