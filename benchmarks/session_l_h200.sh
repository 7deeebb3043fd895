#!/usr/bin/env bash
# H200 run L (issue 11: compile=True as regional compilation, fuse_projections), on the
# two-GPU kind so that part 2 can also time the data-parallel example (issue 15) at scale.
#   bash benchmarks/session_l_h200.sh OUT 1   device tests; llama-8b bench (bf16, 128 + 512)
#   bash benchmarks/session_l_h200.sh OUT 2   llama-1b bench; data-parallel example, 1024 prompts
# Each bench: batch 1 with HF static cache + compile in the same run (the ratio of the issue),
# then batch 64 and 256 with graphcap's modes only; --fuse-projections on, cold compile caches.
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
cache=$(mktemp -d)
export TORCHINDUCTOR_CACHE_DIR=$cache/inductor TRITON_CACHE_DIR=$cache/triton CUDA_VISIBLE_DEVICES=0

bench() {  # MODEL SIZES MODES TAG BUDGET
    step_bench "$out" -mgraphcap.bench "$@"
    tail -12 "$out/bench-$1-$4.txt"
}

if [[ $2 == 1 ]]; then
    timeout 150 $py -m pytest -q -rs -m device tests backends/cuda/tests >"$out/device-tests-l.log" 2>&1
    tail -5 "$out/device-tests-l.log"
    bench llama-8b 1 hf-static-compile,graphcap-graph,graphcap-graph-compiled bs1 150
    bench llama-8b 64,256 graphcap-graph,graphcap-graph-compiled bs64-256 170
else
    bench llama-1b 1 hf-static-compile,graphcap-graph,graphcap-graph-compiled bs1 90
    bench llama-1b 64,256 graphcap-graph,graphcap-graph-compiled bs64-256 90
    unset CUDA_VISIBLE_DEVICES
    export PATH=/tmp/env-new/bin:$PATH
    for n in 1 2; do
        timeout 100 python3 -m torch.distributed.run --nproc-per-node "$n" --master-port 29502 \
            examples/data_parallel_rollout.py --model llama-1b --prompts 1024 --prompt-len 128 \
            --max-new-tokens 128 --warmup 2>/dev/null | grep world | tee -a "$out/dp-llama1b-1024.json"
    done
fi
