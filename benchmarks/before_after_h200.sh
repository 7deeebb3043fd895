#!/usr/bin/env bash
# The same H200 runs on an older checkout and on this tree, in one session (issue 9's proof that
# the rollout redesign keeps tokens and speed):
#
#   git archive <old commit> | tar -x -C .old      # here, before sending the tree
#   bash benchmarks/before_after_h200.sh .old RESULTS_DIR
#
# Each tree gets its own environment over the machine's torch (as backends/cuda/run_on_gpu.sh
# builds it): graphcap bench (gpt2-medium fp16 32+32, llama-8b bf16 128+128, batch 1, eager and
# graph modes) and benchmarks/tokens_h200.py (this tree's script, run against each tree).
set -euo pipefail
old=$(cd "$1" && pwd)
out=$(mkdir -p "$2" && cd "$2" && pwd)
new=$(cd "$(dirname "$0")/.." && pwd)
cd "$new"
source benchmarks/device_env.sh  # make_env; also builds /tmp/env-new for this tree

for tree in old new; do
    dir=$([[ $tree == old ]] && echo "$old" || echo "$new")
    make_env "/tmp/env-$tree" "$dir"
    py=/tmp/env-$tree/bin/python
    (cd "$dir" && "$py" -m graphcap.bench --model gpt2-medium --dtype fp16 --batch-sizes 1 \
        --prompt-len 32 --new-tokens 32 --warmup 1 --repeats 5 \
        --modes graphcap-eager,graphcap-graph --json "$out/bench-gpt2-medium-$tree.json")
    (cd "$dir" && "$py" -m graphcap.bench --model llama-8b --dtype bf16 --batch-sizes 1 \
        --prompt-len 128 --new-tokens 128 --warmup 1 --repeats 3 \
        --modes graphcap-eager,graphcap-graph --json "$out/bench-llama-8b-$tree.json")
    "$py" "$new/benchmarks/tokens_h200.py" "$out/tokens-$tree.json"
done
