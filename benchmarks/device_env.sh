#!/usr/bin/env bash
# Sourced by the H200 scripts. make_env ENV_DIR TREE: an environment over the machine's own
# torch (nothing is fetched; its torch is never replaced) with TREE's graphcap and graphcap-cuda
# installed editable. Sourcing it also builds /tmp/env-new for this tree and sets $py to it;
# cold_compile_caches gives the caller empty compile caches.
export GRAPHCAP_BACKEND=cuda HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1

make_env() {
    if [[ ! -x $1/bin/python ]]; then
        python3 -m venv "$1"
        local purelib
        purelib=$("$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        python3 -c 'import site; print("\n".join(site.getsitepackages()))' >"$purelib/_machine.pth"
    fi
    "$1/bin/python" -m pip install -q --no-build-isolation --no-deps -e "$2" -e "$2/backends/cuda"
}

make_env /tmp/env-new "$PWD"
py=/tmp/env-new/bin/python

# Fresh, empty compile caches (Inductor's and Triton's) for the calling script, so the first
# calls it times are cold.
cold_compile_caches() {
    local cache
    cache=$(mktemp -d)
    export TORCHINDUCTOR_CACHE_DIR=$cache/inductor TRITON_CACHE_DIR=$cache/triton
}

# step_bench OUT SCRIPT MODEL SIZES MODES TAG BUDGET: graphcap bench as issue 11's runs L-U ran
# it (bf16, 128 + 512 tokens, 3 calls after 1 warm-up, --fuse-projections, compiled at SIZES);
# SCRIPT is -mgraphcap.bench or a wrapper of it; writes OUT/bench-MODEL-TAG.{json,txt}.
step_bench() {
    timeout $(($7 + 60)) $py $2 --model "$3" --batch-sizes "$4" \
        --compile-batch-sizes "$4" --prompt-len 128 --new-tokens 512 --repeats 3 --warmup 1 \
        --modes "$5" --fuse-projections --budget-s "$7" \
        --json "$1/bench-$3-$6.json" >"$1/bench-$3-$6.txt" 2>&1
}

# shown_bench OUT MODEL SIZES MODES TAG BUDGET: step_bench of graphcap bench itself, then the
# rows of its table.
shown_bench() {
    step_bench "$1" -mgraphcap.bench "${@:2}"
    grep -E '^(graphcap|hf)-' "$1/bench-$2-$5.txt"
}

# session_part RUN PART: a session script's work folder /tmp/RUN-PART ($work, $part) with empty
# compile caches, and keep, which tars it into $out/run-RUN-PART.tar ($out: the caller's output
# folder); scripts call keep after each part so a call cut short returns what ran.
session_part() {
    run=$1 part=$2 work=/tmp/$1-$2
    mkdir -p "$work"
    cold_compile_caches
}
keep() { tar -cf "$out/run-$run-$part.tar" -C /tmp "$run-$part"; }
