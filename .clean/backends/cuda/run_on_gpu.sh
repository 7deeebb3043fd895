#!/usr/bin/env bash
# Run the CUDA backend's tests and the conformance suite on a GPU machine without network.
# Usage (from anywhere): backends/cuda/run_on_gpu.sh [RESULTS_DIR]
# Installs graphcap and graphcap-cuda (editable, no build isolation, no dependencies) into a
# fresh virtual environment that sees the site-packages of the machine's python (PYTHON, default
# python3: the one with the CUDA build of torch), so nothing is fetched, the machine's torch is
# never replaced and its environment is not modified. (`venv --system-site-packages` is not
# enough when that python is itself a virtual environment: it would see only the base python.)
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
results="$(mkdir -p "${1:-$repo}" && cd "${1:-$repo}" && pwd)"
env_dir="${GRAPHCAP_GPU_ENV:-/tmp/graphcap-gpu-env}"
python="${PYTHON:-python3}"
"$python" -c 'import torch' || { echo "$python cannot import torch; set PYTHON" >&2; exit 2; }
"$python" -m venv "$env_dir"
purelib="$("$env_dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$python" -c 'import site; print("\n".join(site.getsitepackages()))' \
    >"$purelib/_graphcap_machine_site.pth"
"$env_dir/bin/python" -m pip install --quiet --no-build-isolation --no-deps \
    -e "$repo" -e "$repo/backends/cuda"
export GRAPHCAP_BACKEND=cuda
status=0
"$env_dir/bin/python" -m pytest -q -rs "$repo/backends/cuda/tests" || status=$?
cd "$results"
"$env_dir/bin/python" -m graphcap.testing -q \
    --graphcap-json "$results/conformance-cuda.json" \
    || status=$?
exit "$status"
