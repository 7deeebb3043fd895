#!/usr/bin/env bash
# One H200 call: tokens before/after the redesign (needs .old, see before_after_h200.sh), the
# device tests, the conformance suite, and the host-overhead profile. Results in $1 (one tarball
# plus the logs, to stay within the tool's file count).
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
for tree in old new; do
    dir=$([[ $tree == old ]] && echo .old || echo .)
    make_env /tmp/env-$tree $dir
done
/tmp/env-new/bin/python -m pytest -q -rs -m device tests backends/cuda/tests -p no:cacheprovider \
    >"$out/device-tests.log" 2>&1; tail -5 "$out/device-tests.log"
/tmp/env-new/bin/python -m graphcap.testing -q --graphcap-json "$out/cuda-h200.json" \
    >"$out/conformance-cuda.log" 2>&1; tail -3 "$out/conformance-cuda.log"
/tmp/env-new/bin/python benchmarks/host_overhead_h200.py >"$out/host-overhead.log" 2>&1
head -3 "$out/host-overhead.log"
mkdir -p /tmp/tok
for tree in old new; do
    (cd $([[ $tree == old ]] && echo .old || echo .) && /tmp/env-$tree/bin/python \
        "$OLDPWD/benchmarks/tokens_h200.py" /tmp/tok/tokens-$tree.json) >/dev/null 2>&1
done
/tmp/env-new/bin/python benchmarks/tokens_compare.py /tmp/tok/tokens-old.json /tmp/tok/tokens-new.json \
    | tee "$out/tokens-compare.txt"
tar -czf "$out/tokens.tgz" -C /tmp/tok .
