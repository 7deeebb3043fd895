#!/usr/bin/env bash
# Run the CUDA backend's tests and the conformance suite on a GPU machine without network.
# Usage (from anywhere): backends/cuda/run_on_gpu.sh [RESULTS_DIR]
# Installs graphcap and graphcap-cuda (editable, no build isolation, no dependencies) into a
# virtual environment that sees the machine's own torch and transformers, so nothing is fetched
# and the CUDA build of torch is never replaced.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
results="$(mkdir -p "${1:-$repo}" && cd "${1:-$repo}" && pwd)"
env_dir="${GRAPHCAP_GPU_ENV:-/tmp/graphcap-gpu-env}"
python3 -m venv --system-site-packages "$env_dir"
"$env_dir/bin/python" -m pip install --quiet --no-build-isolation --no-deps \
    -e "$repo" -e "$repo/backends/cuda"
export GRAPHCAP_BACKEND=cuda
status=0
"$env_dir/bin/python" -m pytest -q -rs "$repo/backends/cuda/tests" || status=$?
cd "$results"
"$env_dir/bin/python" -m graphcap.testing -q --graphcap-json "$results/conformance-cuda.json" \
    || status=$?
exit "$status"
