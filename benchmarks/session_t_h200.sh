#!/usr/bin/env bash
# H200 run T (issue 11): programmatic dependent launch (graphcap_cuda.launch) and other step
# variants, each a `graphcap bench` of the compiled step with module settings changed
# (benchmarks/bench_knobs.py), all in one call:
#   bash benchmarks/session_t_h200.sh OUT MODEL BATCHES NAME=KNOBS...
# e.g. NAME "off" with KNOBS "launch.ENABLED=0"; an empty KNOBS is the tree as committed. A call
# returns at most 8 files: one JSON per variant, the tables in OUT/run-t-MODEL.log.
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
model=$2
sizes=$3
shift 3
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
cold_compile_caches
$py -c 'import torch, triton, torch._inductor.config as c; print("torch", torch.__version__, "triton", triton.__version__, "inductor pdl", hasattr(c.triton, "enable_pdl"))'
for variant in "$@"; do
    name=${variant%%=*}
    knobs=${variant#*=}
    GRAPHCAP_KNOBS=$knobs timeout 150 $py benchmarks/bench_knobs.py --model "$model" \
        --batch-sizes "$sizes" --compile-batch-sizes "$sizes" --prompt-len 128 \
        --new-tokens 512 --repeats 3 --warmup 1 --modes graphcap-graph-compiled \
        --fuse-projections --budget-s 60 --json "$out/bench-$model-t-$name.json" \
        >/tmp/bench-t.txt 2>&1
    echo "$name ($knobs):"
    grep -E '^graphcap-graph-compiled|Error|error:' /tmp/bench-t.txt | head -4
done | tee -a "$out/run-t-$model.log"
