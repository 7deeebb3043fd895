#!/usr/bin/env bash
# Distributed rollouts on two H200s (kind nvidia-h200-x2): the runs behind docs/distributed.md.
#
#   bash benchmarks/distributed_h200.sh RESULTS_DIR
#
# Expects the machine's own python3 with torch + transformers 5.17 and graphcap installed with
#   pip install --no-build-isolation --no-deps -e . ./backends/cuda
# No network is needed (random-weight presets). NVLink multicast stays off (machine rule).
#   1. tensor parallelism (transformers tp_plan="auto") over 2 GPUs, llama-1b in fp32 and bf16:
#      graph == eager per rank and across ranks (exact in fp32), decode step time vs one GPU,
#      recapture agreement
#   2. the data-parallel example at 1 and 2 ranks, llama-1b bf16: tokens/s
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: $0 RESULTS_DIR" >&2
    exit 2
fi
OUT=$1
mkdir -p "$OUT"
cd "$(dirname "$0")/.."

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export GRAPHCAP_BACKEND=cuda HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

for dtype in fp32 bf16; do
    python3 -m torch.distributed.run --nproc-per-node 2 --master-port 29501 \
        benchmarks/distributed_tp.py "$OUT/tp_llama1b_$dtype.json" --model llama-1b --dtype $dtype
done

for n in 1 2; do
    python3 -m torch.distributed.run --nproc-per-node "$n" --master-port 29502 \
        examples/data_parallel_rollout.py --model llama-1b --prompts 128 --prompt-len 128 \
        --max-new-tokens 128 --warmup --out "$OUT/dp_llama1b_$n.pt" | tee "$OUT/dp_llama1b_$n.json"
done
