#!/usr/bin/env bash
# The benchmark suite on one H200: every figure of docs/benchmarks.md, as JSON (and a log per
# file) in OUT, each file named by what it measures.
#
#   bash benchmarks/h200.sh OUT [PART...]      # no PART: every one-GPU part, in this order
#
#   round-llama-1b   graphcap bench --workload rl-round, the default configuration: a GRPO-shaped
#                    round (32 prompts of 64-256 tokens x 8 samples, temperature 1, rows ending at
#                    EOS ids) for llama-1b (up to 1024 new tokens), from empty caches: HF generate
#                    (its first round only), the drop-in, the engine's static and continuous (128
#                    slots) paths, first round and 2 steady rounds each
#   round-llama-8b   the same for llama-8b (up to 512 new tokens)
#   round            both of the above (two commands' worth of time)
#   iteration-llama-1b  the round as a trainer lives it (graphcap bench --between): the drop-in
#                    and the static path, 3 rounds each back to back, after a sleep and a
#                    training step, and after every parameter moved (not in the default list)
#   iteration-llama-8b  the same for llama-8b (up to 512 new tokens), the static path
#   iteration-hf     HF generate in the same loop: llama-1b, one round after a training step
#                    (not in the default list)
#   sharded          ZeRO-3's gather and FSDP2 at one rank through the drop-in: every round from
#                    the first round's graphs, tokens equal a never-sharded twin's (not in the
#                    default list)
#   sampler          the fused sampler: kernel alone (sampler_h200.py), decode steps at each
#                    truncation (profile_decode.py), the llama-1b round at top-p 0.95 and T=1
#                    (not in the default list)
#   trainer-exact    the device test of trainer-exact rollouts and trainer_exact_h200.py (its
#                    cost and the mismatch table), llama-1b (not in the default list)
#   exact-profile    where trainer-exact time goes (exact_kernels_h200.py): each exact kernel
#                    against the operation it replaces at llama-1b's and llama-8b's decode and
#                    trainer shapes, and kernel tables of a trainer-exact decode step and trainer
#                    forward + backward, llama-1b (about 150 s; not in the default list)
#   exact-cost       trainer-exact's cost (trainer_exact_h200.py's rollout and trainer parts,
#                    llama-1b), then exact_kernels_h200.py's profile, tiles and products parts
#                    for llama-1b (not in the default list; one command's time)
#   verify           what changed since the last device run, correctness first: trainer-exact's
#                    device test, the sampler's and exact kernels' tests on the GPU, the sharded
#                    check, the conformance suite's memory-region checks (not in the default
#                    list; about 8 minutes)
#   exact-cost-llama-8b  trainer-exact's cost for llama-8b (trainer batch 8 x 512; not in the
#                    default list)
#   recheck          the kernel tests natively on the GPU, trainer-exact's device test and its
#                    llama-1b cost, in about three minutes (not in the default list)
#   sleep-checks     the device tests of sleeps that keep the graphs and the conformance
#                    suite's memory-region checks (not in the default list)
#   steps-llama-8b   graphcap bench, llama-8b at batch 1, 64 and 256 (bf16, 128 prompt + 512
#                    new tokens, --repeats 2 --warmup 1, each mode and batch size in its own
#                    process): graphcap-graph (the default configuration) and
#                    graphcap-graph-uncompiled, and hf-static-compile at batch 1 (the ratio)
#   steps-llama-1b   the same for llama-1b
#   steps            both of the above (two commands' worth of time)
#   default-step     llama-8b at batch 1 (128 + 512): graphcap-graph and
#                    graphcap-graph-uncompiled, each in a fresh process from empty caches, then
#                    graphcap-graph again in a fresh process with the caches they left, then
#                    hf-static-compile from empty caches (the default configuration's step, its
#                    cold and warm first calls and the ratio to HF, in about 4 minutes)
#   first-call       the first call in a fresh process, llama-8b and llama-1b at batch 1, 128 +
#                    128 tokens: graphcap-graph and hf-static-compile with empty Inductor, Triton
#                    and graphcap compile caches, then graphcap-graph again with the caches the
#                    first process left; the report splits each first call into its phases
#                    (GRAPHCAP_FIRST_CALL_MODELS: the models, default "llama-8b llama-1b")
#   first-call-triage  where a first call goes: first_call_profile.py (llama-8b, batch 1,
#                    128 + 128, cProfile) from empty caches, then from the caches it left, each
#                    listing the Triton kernels it compiled and dynamo's and inductor's cache
#                    counters (not in the default list)
#   first-call-levers  a warm first call's wall-clock phases (first_call_profile.py --no-profile,
#                    batch 1, 128 + 128): for llama-1b then llama-8b, one process from empty
#                    caches, then fresh processes from the caches it left, as committed and with
#                    each lever of GRAPHCAP_WARM_LEVERS (default "compile-threads-1": inductor
#                    compiles in-process, no worker pool), twice each, alternating (not in the
#                    default list)
#   bs1-ratio        llama-8b at batch 1: graphcap-graph and hf-static-compile, each in a fresh
#                    process from empty caches (not in the default list)
#   joined-steps-llama-8b  the steps-llama-8b workload (graphcap-graph at batch 1, 64, 256)
#                    with --fuse-projections and with --no-fuse-projections (not in the default
#                    list; the evidence for CUDA's joins_projections_by_default)
#   joined-steps-llama-1b  the same for llama-1b
#   kernels          the CUDA plugin's kernels alone against PyTorch's (kernels_h200.py)
#   split-kv-launch  every launch of the split-KV kernel at 1-32 rows (kernels_h200.py)
#   default-checks   the device tests of the rollout paths and the drop-in, and the CUDA
#                    attention function on a block table (a quicker checks; not in the default list)
#   checks           the device tests, the plugin's tests on the GPU, the CUDA conformance suite
#   profile          where a step's time goes (profile_decode.py, llama-8b at batch 1, 64,
#                    256) and a first call's (first_call_profile.py, cold caches)
#   continuous       the continuous-batching workloads (continuous.py)
#   logits           bf16 teacher-forced logits against fp32 (logits_vs_fp32.py)
#   trl              TRL's GRPOTrainer on a llama-1b-shaped model (examples/trl_grpo.py), with
#                    and without graphcap: rollout seconds per step, completions compared
#   gemm-levers      llama-8b at batch 256, the default configuration as it is, with PyTorch's
#                    TunableOp tuning its GEMMs, with inductor's max-autotune of GEMMs, and with
#                    max-autotune offered inductor's persistent TMA templates too (each in a fresh
#                    process from empty caches; GRAPHCAP_GEMM_LEVERS picks some, default all;
#                    not in the default list)
#   distributed      two GPUs (not in the default list): tensor parallelism (tensor_parallel.py)
#                    and the data-parallel example at 1 and 2 ranks
#
# Each part fits in under 9 minutes (LIMIT); a run started near the end of a part is skipped
# and says so. Run one part a command where commands are cut at 10 minutes.
#
# The machine: its own python3 with torch (2.11) and transformers (5.17) installed, no network
# (every model is a random-weight preset). The script makes an environment over that python's
# packages ($GRAPHCAP_ENV, default /tmp/graphcap-h200-env; nothing is downloaded and the
# machine's torch is never replaced) and installs this tree's graphcap and graphcap-cuda into it
# with pip install --no-build-isolation --no-deps -e . -e ./backends/cuda.
set -uo pipefail

if [[ $# -lt 1 ]]; then
    sed -n '2,/^set /p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
shift
cd "$(dirname "$0")/.."

DEFAULT_PARTS=(round steps-llama-8b steps-llama-1b first-call trl checks kernels split-kv-launch
    profile continuous logits)
PARTS=("$@")
[[ ${#PARTS[@]} -eq 0 ]] && PARTS=("${DEFAULT_PARTS[@]}")
LIMIT=${GRAPHCAP_PART_LIMIT_S:-530} # seconds a part may take
#: graphcap bench's workload for every step figure: the default configuration (no options)
STEP=(--dtype bf16 --prompt-len 128 --new-tokens 512 --repeats 2 --warmup 1)

export GRAPHCAP_BACKEND=cuda HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# An environment over the machine's python (a .pth file names its site-packages, which a venv's
# system_site_packages cannot see when that python is itself a venv), this tree installed.
ENV=${GRAPHCAP_ENV:-/tmp/graphcap-h200-env}
# Python's bytecode cache in the environment: the machine's torch ships no .pyc files, which a pip
# install writes, so without it every process compiled torch's sources again (1.6 s of a warm
# first call on llama-8b, benchmarks/results/profiles/first-call-profile-llama-8b-warm-b4ce2c0.txt).
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=$ENV/pycache
if [[ ! -x $ENV/bin/python ]]; then
    python3 -m venv --without-pip "$ENV" || exit 1 # pip, setuptools: the machine's
    purelib=$("$ENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    python3 -c 'import site; print("\n".join(site.getsitepackages()))' >"$purelib/_machine.pth"
fi
"$ENV/bin/python" -m pip install -q --no-build-isolation --no-deps -e . -e ./backends/cuda ||
    exit 1
# the CUDA plugin's optional sleep extra (torch_memory_saver), where its wheel was carried in
# .whl/ (the machine has no network)
for wheel in .whl/torch_memory_saver-*.whl; do
    [[ -f $wheel ]] && "$ENV/bin/python" -m pip install -q --no-deps "$wheel"
done
# FlashInfer's sampling kernels for sampler_h200.py, where slim wheels were carried in
# .whl/flashinfer/ (its prebuilt sm_90a sampling module, no JIT; how they are built:
# .whl/flashinfer/BUILD.md): FlashInfer, tvm-ffi and pynvml always, its pure-Python
# dependencies only where the machine lacks them
fi_wheels=()
for wheel in .whl/flashinfer/*.whl; do
    [[ -f $wheel ]] || continue
    name=$(basename "$wheel")
    name=${name%%-*}
    case $name in
    flashinfer_python | apache_tvm_ffi | nvidia_ml_py) ;;
    *) "$ENV/bin/python" -c 'import importlib.metadata as m, sys; m.version(sys.argv[1])' "$name" \
        2>/dev/null && continue ;;
    esac
    fi_wheels+=("$wheel")
done
if [[ ${#fi_wheels[@]} -gt 0 ]]; then
    "$ENV/bin/python" -m pip install -q --no-deps "${fi_wheels[@]}"
    export FLASHINFER_DISABLE_JIT=1 # a missing prebuilt module fails at once, not in nvcc
fi
py=$ENV/bin/python
# the tree's commit: GRAPHCAP_COMMIT, else git's HEAD, marked "-modified" where tracked files
# differ from it (a copy of a working tree can carry an older HEAD than its files)
COMMIT=${GRAPHCAP_COMMIT:-$(git rev-parse --short=7 HEAD 2>/dev/null || echo unknown)}
if [[ -z ${GRAPHCAP_COMMIT:-} ]] && ! git diff --quiet HEAD -- 2>/dev/null; then
    COMMIT+=-modified
fi
FAILED=()

# cold_caches: empty Inductor, Triton and graphcap compile caches for what follows (the scripts'
# engines take graphcap's from GRAPHCAP_COMPILE_CACHE, graphcap bench from --compile-cache).
cold_caches() {
    CACHE=$(mktemp -d)
    export TORCHINDUCTOR_CACHE_DIR=$CACHE/inductor TRITON_CACHE_DIR=$CACHE/triton
    export GRAPHCAP_COMPILE_CACHE=$CACHE/graphcap
    COMPILE_CACHE=$GRAPHCAP_COMPILE_CACHE
}
left() { echo $((LIMIT - ($(date +%s) - PART_START))); }
fail() {
    echo "== $1 FAILED (see $OUT/$1.log)" >&2
    FAILED+=("$1")
}
# run NAME SECONDS CMD...: CMD with its output in OUT/NAME.log, cut after SECONDS (or what is
# left of the part); skipped when less than a minute is left.
run() {
    local name=$1 seconds=$2 left
    shift 2
    left=$(left)
    if ((left < 60)); then
        echo "== $name: skipped, ${left}s of the part left" >&2
        FAILED+=("$name(skipped)")
        return 0
    fi
    ((seconds > left)) && seconds=$left
    echo "== $name (at most ${seconds}s)" >&2
    timeout "$seconds" "$@" >"$OUT/$name.log" 2>&1 || fail "$name"
    tail -3 "$OUT/$name.log" >&2
}
# bench NAME LONGEST ARGS...: graphcap bench into OUT/NAME.json (table in NAME.txt, progress in
# NAME.log); a (mode, batch size) pair starts only while LONGEST seconds (its longest pair) are
# left of the part, later ones are reported skipped.
bench() {
    local name=$1 budget left
    left=$(left)
    budget=$((left - $2))
    shift 2
    if ((budget < 10)); then
        echo "== $name: skipped, ${left}s of the part left" >&2
        FAILED+=("$name(skipped)")
        return 0
    fi
    echo "== $name (sweep budget ${budget}s)" >&2
    timeout $((left - 5)) "$py" -m graphcap.bench --budget-s "$budget" --json "$OUT/$name.json" \
        "$@" 2>"$OUT/$name.log" >"$OUT/$name.txt" || fail "$name"
    grep -E '^(graphcap|hf)-|^  graphcap' "$OUT/$name.txt" >&2
}

# steps MODEL LONGEST: the step figures of MODEL (LONGEST: its longest pair, in seconds).
steps() {
    cold_caches
    bench "steps-$1-hf-static-compile" "$2" --model "$1" --batch-sizes 1 "${STEP[@]}" \
        --isolate --modes hf-static-compile
    bench "steps-$1" "$2" --model "$1" --batch-sizes 1,256,64 --compile-batch-sizes 1,256,64 \
        "${STEP[@]}" --isolate --modes graphcap-graph,graphcap-graph-uncompiled \
        --compile-cache "$COMPILE_CACHE"
}
# round: the rl-round figures of llama-1b then llama-8b (one cold cache: the later modes of a
# model find what its first graphcap mode compiled, as a trainer's later rounds would).
part_round_llama_1b() {
    cold_caches
    bench round-llama-1b 120 --workload rl-round --model llama-1b --new-tokens 1024 \
        --repeats 2 --hf-repeats 0 --compile-cache "$COMPILE_CACHE"
}
part_round_llama_8b() {
    cold_caches
    bench round-llama-8b 150 --workload rl-round --model llama-8b --new-tokens 512 \
        --repeats 2 --hf-repeats 0 --compile-cache "$COMPILE_CACHE"
}
# iteration MODEL NEW LONGEST MODES: the round as a trainer lives it: steady rounds back to back,
# then each round after a sleep and a training step, then each after every parameter moved
# (graphcap bench --between).
iteration() {
    cold_caches
    local between
    for between in nothing sleep-train move; do
        bench "iteration-$1-$between" "$3" --workload rl-round --model "$1" --new-tokens "$2" \
            --repeats 3 --modes "$4" --between "$between" --compile-cache "$COMPILE_CACHE"
    done
}
part_iteration_llama_1b() { iteration llama-1b 1024 60 graphcap-drop-in,graphcap-graph; }
part_iteration_llama_8b() { iteration llama-8b 512 90 graphcap-graph; }
# iteration-hf: HF generate in the same loop (a round after a training step; generate holds
# nothing between calls, so it has no sleep), one steady round, llama-1b
part_iteration_hf() {
    bench iteration-llama-1b-hf 200 --workload rl-round --model llama-1b --new-tokens 1024 \
        --modes hf-eager --hf-repeats 1 --between sleep-train
}
# sampler: the fused truncate-and-draw kernel alone against the core's math at llama-1b's and
# llama-8b's decode shapes, a decode step at each truncation (profile_decode.py's cases, with the
# kernel then with the core's math), and the llama-1b round at top-p 0.95 beside T=1 (one run)
SAMPLED=(t1 topp95 topk50 minp05 topk50-topp95)
part_sampler() {
    local small="llama-1b:bf16:256" large="llama-8b:bf16:64" s
    for s in "${SAMPLED[@]}"; do small+=",llama-1b:bf16:256:$s" large+=",llama-8b:bf16:64:$s"; done
    run sampler-kernels 90 "$py" benchmarks/sampler_h200.py "$OUT/sampler-kernels.json" \
        --shapes 256x128256,64x128256
    run sampler-steps-llama-1b 150 "$py" benchmarks/profile_decode.py \
        "$OUT/sampler-steps-llama-1b.json" --new-tokens 128 --cases "$small"
    run sampler-steps-llama-8b 150 "$py" benchmarks/profile_decode.py \
        "$OUT/sampler-steps-llama-8b.json" --new-tokens 128 --cases "$large"
    run sampler-steps-core 90 "$py" benchmarks/profile_decode.py \
        "$OUT/sampler-steps-core.json" --new-tokens 128 --core-sampler \
        --cases llama-1b:bf16:256:t1,llama-1b:bf16:256:topp95
    cold_caches
    bench round-llama-1b-t1 60 --workload rl-round --model llama-1b --new-tokens 1024 \
        --repeats 3 --modes graphcap-graph --compile-cache "$COMPILE_CACHE"
    bench round-llama-1b-topp95 60 --workload rl-round --model llama-1b --new-tokens 1024 \
        --repeats 3 --modes graphcap-graph,graphcap-drop-in --top-p 0.95 \
        --compile-cache "$COMPILE_CACHE"
}
# trainer-exact: the device test of trainer-exact rollouts (bf16 log-probs equal to the trainer's
# bit for bit, a small llama and llama-1b, gradients) and benchmarks/trainer_exact_h200.py (the
# mode's cost and the mismatch table), llama-1b
part_trainer_exact() {
    run exact-device-test 240 "$py" -m pytest -q -x -s tests/test_device_trainer_exact.py
    run exact-llama-1b 330 "$py" benchmarks/trainer_exact_h200.py "$OUT/trainer-exact-llama-1b.json"
}
# exact-profile: each trainer-exact kernel against the operation it replaces, and where a
# trainer-exact decode step's and trainer step's device time goes (exact_kernels_h200.py)
part_exact_profile() {
    run exact-profile 200 "$py" benchmarks/exact_kernels_h200.py "$OUT/exact-profile.json"
}
# exact-cost: the trainer-exact rollout's and trainer step's cost against the default's
# (trainer_exact_h200.py without its mismatch table), llama-1b, then the profile's kernel tables
# and the product's tiles (exact_kernels_h200.py), in one command's time
part_exact_cost() {
    run exact-cost-llama-1b 200 "$py" benchmarks/trainer_exact_h200.py \
        "$OUT/trainer-exact-cost-llama-1b.json" --parts rollout,trainer
    run exact-profile 300 "$py" benchmarks/exact_kernels_h200.py "$OUT/exact-profile.json" \
        --models llama-1b --parts profile,tiles,products
}
# exact-cost-llama-8b: the same cost for llama-8b (a trainer batch of 8 x 512 fits beside it)
part_exact_cost_llama_8b() {
    run exact-cost-llama-8b 300 "$py" benchmarks/trainer_exact_h200.py \
        "$OUT/trainer-exact-cost-llama-8b.json" --model llama-8b --train-batch 8 \
        --parts rollout,trainer
}
# sharded: ZeRO-3's gather and FSDP2 through the drop-in at one rank (benchmarks/sharded_check.py)
part_sharded() {
    run sharded-check 150 "$py" benchmarks/sharded_check.py "$OUT/sharded-check.json"
}
# sleep-checks: the device tests of sleeps that keep the graphs and the conformance suite's
# memory-region checks
part_sleep_checks() {
    run sleep-check 120 "$py" benchmarks/sleep_check.py
    run sleep-device-tests 240 "$py" -m pytest -q -s tests/test_device_sleep.py \
        tests/test_device_rollout.py -k sleep
    run sleep-conformance 120 "$py" -m graphcap.testing -q -k "region or capabilities" \
        --graphcap-json "$OUT/sleep-conformance.json"
}
# exact_device_test SECONDS: trainer-exact's device test (bf16 log-probs equal to the trainer's)
exact_device_test() {
    run verify-exact "$1" "$py" -m pytest -q -x -p no:cacheprovider tests/test_device_trainer_exact.py
}
# kernel_tests_on_gpu SECONDS: the sampler's and the exact kernels' tests natively on the GPU,
# not under the interpreter
kernel_tests_on_gpu() {
    run verify-kernels "$1" "$py" -m pytest -q -p no:cacheprovider \
        backends/cuda/tests/test_sampler_kernel.py backends/cuda/tests/test_exact_kernels.py \
        backends/cuda/tests/test_exact_pointwise.py
}
# verify: what changed since the last device run, correctness first, in one command's time:
# the two above, the sharded check and the conformance suite's memory-region checks (two
# engines, one asleep then shut down)
part_verify() {
    exact_device_test 150
    kernel_tests_on_gpu 150
    run verify-sharded 100 "$py" benchmarks/sharded_check.py "$OUT/sharded-check.json"
    run verify-regions 80 "$py" -m graphcap.testing -q -k memory_region \
        --graphcap-json "$OUT/verify-regions.json"
}
# recheck: the shortest correctness-and-cost pass after kernel changes, for a short device
# budget: trainer-exact's device test, the kernel tests on the GPU, its llama-1b cost
part_recheck() {
    exact_device_test 100
    kernel_tests_on_gpu 100
    run exact-cost-llama-1b 80 "$py" benchmarks/trainer_exact_h200.py \
        "$OUT/trainer-exact-cost-llama-1b.json" --parts rollout,trainer --repeats 2
}
part_steps_llama_8b() { steps llama-8b 100; }
part_steps_llama_1b() { steps llama-1b 60; }

part_default_step() {
    cold_caches
    bench default-step-llama-8b-bs1-cold 50 --model llama-8b --batch-sizes 1 "${STEP[@]}" \
        --isolate --modes graphcap-graph,graphcap-graph-uncompiled --compile-cache "$COMPILE_CACHE"
    bench default-step-llama-8b-bs1-warm 40 --model llama-8b --batch-sizes 1 "${STEP[@]}" \
        --isolate --modes graphcap-graph --compile-cache "$COMPILE_CACHE"
    cold_caches # HF's compile from empty caches too
    bench default-step-llama-8b-bs1-hf 80 --model llama-8b --batch-sizes 1 "${STEP[@]}" \
        --isolate --modes hf-static-compile
}

# first-call: each model's cold call (graphcap, then HF), then its warm one from the caches the
# cold one left, so a part cut at its limit keeps whole pairs
part_first_call() {
    local model
    for model in ${GRAPHCAP_FIRST_CALL_MODELS:-llama-8b llama-1b}; do
        cold_caches
        bench "first-call-cold-$model-bs1" 90 --model $model --batch-sizes 1 --dtype bf16 \
            --prompt-len 128 --new-tokens 128 --repeats 1 --warmup 0 --isolate \
            --modes graphcap-graph,hf-static-compile --compile-cache "$COMPILE_CACHE"
        bench "first-call-warm-$model-bs1" 30 --model $model --batch-sizes 1 --dtype bf16 \
            --prompt-len 128 --new-tokens 128 --repeats 1 --warmup 0 --isolate \
            --modes graphcap-graph --compile-cache "$COMPILE_CACHE"
    done
}

part_first_call_triage() {
    cold_caches
    local name
    for name in cold warm; do
        run "first-call-triage-llama-8b-$name" 150 "$py" benchmarks/first_call_profile.py \
            --new-tokens 128 --warm-forward --compile-cache "$COMPILE_CACHE" \
            "$OUT/first-call-triage-llama-8b-$name.txt"
    done
}

# first-call-levers: the warm first call's phases as committed and with each lever, alternating,
# twice each, from the caches one cold process left (the cold one's phases too)
part_first_call_levers() {
    local model rep lever
    for model in llama-1b llama-8b; do
        cold_caches
        run "first-call-levers-$model-cold" 150 "$py" benchmarks/first_call_profile.py \
            --model $model --new-tokens 128 --warm-forward --no-profile \
            --compile-cache "$COMPILE_CACHE" "$OUT/first-call-levers-$model-cold.txt"
        for rep in 1 2; do
            for lever in none ${GRAPHCAP_WARM_LEVERS:-compile-threads-1}; do
                case $lever in
                compile-threads-1) export TORCHINDUCTOR_COMPILE_THREADS=1 ;;
                esac
                run "first-call-levers-$model-warm-$lever-$rep" 60 "$py" \
                    benchmarks/first_call_profile.py --model $model --new-tokens 128 \
                    --warm-forward --no-profile --compile-cache "$COMPILE_CACHE" \
                    "$OUT/first-call-levers-$model-warm-$lever-$rep.txt"
                unset TORCHINDUCTOR_COMPILE_THREADS
            done
        done
    done
}

# bs1-ratio: llama-8b's default step at batch 1 and HF's static cache + compile, each in a fresh
# process from empty caches (the ratio in one run, without the other batch sizes' time)
part_bs1_ratio() {
    cold_caches
    bench bs1-ratio-llama-8b 100 --model llama-8b --batch-sizes 1 "${STEP[@]}" --isolate \
        --modes graphcap-graph,hf-static-compile --compile-cache "$COMPILE_CACHE"
}

# joined MODEL LONGEST: the default configuration's steps of MODEL at batch 1, 64 and 256 with
# q/k/v and gate/up joined and without, each pair in a fresh process from the same caches.
joined() {
    cold_caches
    local fuse
    for fuse in fuse no-fuse; do
        bench "joined-steps-$1-$fuse" "$2" --model "$1" --batch-sizes 1,64,256 "${STEP[@]}" \
            --isolate --modes graphcap-graph --$fuse-projections --compile-cache "$COMPILE_CACHE"
    done
}
part_joined_steps_llama_8b() { joined llama-8b 100; }
part_joined_steps_llama_1b() { joined llama-1b 60; }

part_kernels() {
    cold_caches
    run kernels 480 "$py" benchmarks/kernels_h200.py "$OUT/kernels.json"
}

part_split_kv_launch() {
    cold_caches
    run split-kv-launch 480 "$py" benchmarks/kernels_h200.py "$OUT/split-kv-launch.json" \
        --parts launch
}

# default-checks: the device tests of the rollout paths and the drop-in (default configuration:
# compiled and joined on CUDA), and the CUDA attention function on a block table
part_default_checks() {
    cold_caches
    run device-tests-default 300 "$py" -m pytest -q -rs -p no:cacheprovider -m device \
        tests/test_device_rollout.py tests/test_device_drop_in.py \
        "backends/cuda/tests/test_split_kv.py::test_the_attention_function_reads_the_table_in_decode_and_gathers_otherwise"
}

part_checks() {
    cold_caches
    run device-tests 330 "$py" -m pytest -q -rs -p no:cacheprovider -m device tests \
        backends/cuda/tests
    run conformance-cuda 150 "$py" -m graphcap.testing -q \
        --graphcap-json "$OUT/conformance-cuda.json"
    run cuda-plugin-tests 240 "$py" -m pytest -q -rs -p no:cacheprovider backends/cuda/tests
}

# gemm-levers: llama-8b batch 256 (the GEMM-bound step) in the default configuration, as it
# is, with PyTorch's TunableOp tuning its GEMMs in the warm-up (results in OUT), and with
# inductor's max-autotune of GEMMs (its Triton templates and cuBLAS), and with max-autotune
# offered inductor's persistent TMA templates for Hopper too (off unless asked for)
part_gemm_levers() {
    local lever
    for lever in ${GRAPHCAP_GEMM_LEVERS:-none tunableop max-autotune max-autotune-tma}; do
        cold_caches
        case $lever in
        tunableop)
            export PYTORCH_TUNABLEOP_ENABLED=1 PYTORCH_TUNABLEOP_TUNING=1
            export PYTORCH_TUNABLEOP_FILENAME=$OUT/gemm-levers-tunableop-results.csv
            ;;
        max-autotune) export TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1 ;;
        max-autotune-tma) export TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1 ENABLE_PERSISTENT_TMA_MATMUL=1 ;;
        esac
        bench "gemm-levers-$lever-llama-8b-bs256" 150 --model llama-8b --batch-sizes 256 \
            "${STEP[@]}" --isolate --modes graphcap-graph --compile-cache "$COMPILE_CACHE"
        unset PYTORCH_TUNABLEOP_ENABLED PYTORCH_TUNABLEOP_TUNING PYTORCH_TUNABLEOP_FILENAME \
            TORCHINDUCTOR_MAX_AUTOTUNE_GEMM ENABLE_PERSISTENT_TMA_MATMUL
    done
}

part_profile() {
    cold_caches
    run profile-llama-8b 300 "$py" benchmarks/profile_decode.py "$OUT/profile-llama-8b.json" \
        --cases llama-8b:bf16:1,llama-8b:bf16:64,llama-8b:bf16:256 --new-tokens 256
    local attention
    for attention in auto graphcap_gqa_sdpa; do
        cold_caches
        run "first-call-profile-llama-8b-$attention" 100 "$py" benchmarks/first_call_profile.py \
            "$OUT/first-call-profile-llama-8b-$attention.txt" --attention $attention \
            --compile-cache "$COMPILE_CACHE" --warm-forward
    done
}

part_continuous() {
    cold_caches
    run continuous-gpt2-medium 420 "$py" benchmarks/continuous.py \
        "$OUT/continuous-gpt2-medium.json" --require-blocks
}

part_logits() {
    cold_caches
    local batch
    for batch in 8 1; do
        run "logits-vs-fp32-bs$batch" 240 "$py" benchmarks/logits_vs_fp32.py \
            "$OUT/logits-vs-fp32-bs$batch.json" --batch $batch
    done
}

part_trl() {
    cold_caches
    export GRAPHCAP_COMPILE_CACHE=$COMPILE_CACHE
    run trl-grpo-llama-1b 480 "$py" examples/trl_grpo.py \
        --model llama-1b --dtype bf16 --steps 4 --batch-size 8 --generations 4 --new-tokens 128 \
        --words 64 --compare --output-dir "$CACHE/trl" --json "$OUT/trl-grpo-llama-1b.json"
}

part_distributed() {
    local gpus dtype n prompts
    gpus=$("$py" -c 'import torch; print(torch.cuda.device_count())')
    if ((gpus < 2)); then
        echo "== distributed: needs two GPUs, this machine has $gpus" >&2
        FAILED+=("distributed(no second GPU)")
        return 0
    fi
    cold_caches
    for dtype in fp32 bf16; do
        run "tensor-parallel-llama-1b-$dtype" 150 "$py" -m torch.distributed.run \
            --nproc-per-node 2 --master-port 29501 benchmarks/tensor_parallel.py \
            "$OUT/tensor-parallel-llama-1b-$dtype.json" --model llama-1b --dtype $dtype
    done
    for prompts in 128 1024; do
        for n in 1 2; do
            run "data-parallel-llama-1b-$prompts-prompts-$n-ranks" 100 "$py" \
                -m torch.distributed.run --nproc-per-node $n --master-port 29502 \
                examples/data_parallel_rollout.py --model llama-1b --prompts $prompts \
                --prompt-len 128 --max-new-tokens 128 --warmup
            grep world "$OUT/data-parallel-llama-1b-$prompts-prompts-$n-ranks.log" \
                >"$OUT/data-parallel-llama-1b-$prompts-prompts-$n-ranks.json"
        done
    done
}

for part in "${PARTS[@]}"; do
    case $part in
    steps) parts=(steps_llama_8b steps_llama_1b) ;;
    round) parts=(round_llama_1b round_llama_8b) ;;
    round-llama-1b | round-llama-8b | steps-llama-8b | steps-llama-1b | default-step | first-call | first-call-triage | \
        first-call-levers | bs1-ratio | \
        joined-steps-llama-8b | joined-steps-llama-1b | kernels | split-kv-launch | \
        default-checks | checks | profile | continuous | logits | trl | gemm-levers | distributed | \
        iteration-llama-1b | iteration-llama-8b | iteration-hf | sleep-checks | sharded | sampler | trainer-exact | exact-profile | exact-cost | exact-cost-llama-8b | verify | recheck)
        parts=("${part//-/_}")
        ;;
    *)
        echo "unknown part $part" >&2
        exit 2
        ;;
    esac
    for p in "${parts[@]}"; do
        PART_START=$(date +%s)
        echo "== part ${p//_/-}, commit $COMMIT, $(date -u +%FT%TZ)" >&2
        "part_$p"
        echo "${p//_/-} commit=$COMMIT date=$(date -u +%F) seconds=$(($(date +%s) - PART_START))" \
            >>"$OUT/parts.log"
    done
done
echo "results in $OUT; failed or skipped: ${FAILED[*]:-none}" >&2
((${#FAILED[@]} == 0))
