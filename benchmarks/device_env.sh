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

# session_part RUN OUT PART: a session script's output folder OUT ($out, made absolute from
# the directory the script was started in, which its cd to the tree leaves in $OLDPWD) and work
# folder /tmp/RUN-PART ($work, $part) with empty compile caches, and keep, which tars the work
# folder into $out/run-RUN-PART.tar; scripts call keep after each part so a call cut short
# returns what ran.
session_part() {
    run=$1 out=$(cd "$OLDPWD" && mkdir -p "$2" && cd "$2" && pwd) part=$3 work=/tmp/$1-$3
    mkdir -p "$work"
    cold_compile_caches
}
keep() { tar -cf "$out/run-$run-$part.tar" -C /tmp "$run-$part"; }
# variants MODEL SIZES BUDGET NAME=KNOBS...: the compiled step through bench_knobs.py, one
# process per variant (KNOBS as GRAPHCAP_KNOBS; empty: as committed), its rows shown; writes
# $work/bench-MODEL-RUN-NAME.{json,txt} (session_part's $run and $work) and keeps after each.
variants() {
    local model=$1 sizes=$2 budget=$3 variant tag
    for variant in "${@:4}"; do
        tag=$run-${variant%%=*}
        GRAPHCAP_KNOBS=${variant#*=} step_bench "$work" benchmarks/bench_knobs.py "$model" \
            "$sizes" graphcap-graph-compiled "$tag" "$budget"
        echo "${variant%%=*}:"
        grep -E '^graphcap-graph-compiled|Error' "$work/bench-$model-$tag.txt"
        keep
    done
}

# device_checks CASE NAME: the device rollout tests (fp32 tokens of the graph paths), the
# conformance suite and a profile of CASE (profile_decode.py's MODEL:DTYPE:BATCH, 128 + 256
# tokens) into $work: device-tests-RUN.log, conformance-RUN.log and cuda-h200.json,
# profile-decode-RUN-NAME.json and profile-RUN.log.
device_checks() {
    timeout 150 $py -m pytest -q -rs -m device -p no:cacheprovider tests/test_device_rollout.py \
        -k "greedy_graph_equals or compiled or continuous or per_position" \
        >"$work/device-tests-$run.log" 2>&1
    tail -1 "$work/device-tests-$run.log"
    keep
    timeout 100 $py -m graphcap.testing -q --graphcap-json "$work/cuda-h200.json" \
        >"$work/conformance-$run.log" 2>&1
    tail -1 "$work/conformance-$run.log"
    keep
    timeout 70 $py benchmarks/profile_decode.py "$work/profile-decode-$run-$2.json" --fast \
        --cases "$1" --new-tokens 256 >"$work/profile-$run.log" 2>&1
    grep -E '"(kernels_per_step|device_ms_per_step|decode_ms_per_step_wall)"' \
        "$work/profile-$run.log"
}

# isolated_bench MODES NAME TIMEOUT: llama-8b at batch 1, each mode in its own process
# (graphcap bench --isolate, as runs AA and AB took it), into
# $work/bench-llama-8b-bs1-NAME.{json,txt}; its rows shown.
isolated_bench() {
    timeout "$3" $py -m graphcap.bench --model llama-8b --batch-sizes 1 --prompt-len 128 \
        --new-tokens 512 --repeats 3 --warmup 1 --fuse-projections --isolate --modes "$1" \
        --json "$work/bench-llama-8b-bs1-$2.json" >"$work/bench-llama-8b-bs1-$2.txt" 2>&1
    grep -E '^(graphcap|hf)-' "$work/bench-llama-8b-bs1-$2.txt"
    keep
}

# issue11_figures: HF static + compile, the default graph and the compiled step at batch 1
# (isolated_bench), then the compiled step of llama-8b at 64 / 256 and llama-1b at 1 / 64 / 256.
issue11_figures() {
    isolated_bench hf-static-compile,graphcap-graph,graphcap-graph-compiled "isolated-$run" 240
    shown_bench "$work" llama-8b 64,256 graphcap-graph-compiled "bs64-256-$run" 90
    keep
    shown_bench "$work" llama-1b 1,64,256 graphcap-graph-compiled "bs1-64-256-$run" 70
    keep
}
