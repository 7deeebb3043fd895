#!/usr/bin/env bash
# Sourced by the H200 session scripts: an environment over the machine's own torch (nothing is
# fetched) with graphcap and graphcap-cuda installed editable; sets $py to its python.
export GRAPHCAP_BACKEND=cuda HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
if [[ ! -x /tmp/env-new/bin/python ]]; then
    python3 -m venv /tmp/env-new
    purelib=$(/tmp/env-new/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    python3 -c 'import site; print("\n".join(site.getsitepackages()))' >"$purelib/_machine.pth"
fi
py=/tmp/env-new/bin/python
$py -m pip install -q --no-build-isolation --no-deps -e . -e backends/cuda
