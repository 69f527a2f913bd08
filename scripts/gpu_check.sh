#!/usr/bin/env bash
# The CUDA checks (issue 31) in one go, on a GPU machine where torch is installed and
# nothing can be fetched: run from the source tree. Every CUDA test file runs in its own
# process (three at a time, beside the benchmarks) and every benchmark in its own
# process, each under its own time limit, so one crash or hang cannot hide the rest.
# Results go to $OUT (or ./gpu-out): summary.txt, and results.tgz with every log and JSON.
#
#   bash scripts/gpu_check.sh [tests|bench|all] [seconds for the whole run, default 540]
#   TESTS="tests/a.py tests/b.py"  the test files to run (default: every file with a CUDA test)
#   BENCH="capture-L1 bench-L1+graphs"  the benchmarks to run, in order (default: all)
# `race` compiles reduce-overhead and graphopt's level 2 side by side while the tests
# run and times them in turns once the tests are done (benchmarks/cuda_race.py).
set -u
phase=${1:-all}
deadline=$(( $(date +%s) + ${2:-540} ))
out=${OUT:-gpu-out}
logs=$(mktemp -d)
mkdir -p "$out"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 GRAPHOPT_CACHE_DIR=
py=${PYTHON:-python3}
summary=$logs/summary.txt

left() { echo $(( deadline - $(date +%s) )); }

# `step NAME LIMIT COMMAND...`: COMMAND's output to NAME.log, its status to the summary.
step() {
    local name=$1 limit=$2; shift 2
    local budget; budget=$(left)
    (( limit > budget )) && limit=$budget
    if (( limit < 20 )); then echo "$name: skipped, out of time" >>"$summary"; return; fi
    local start; start=$(date +%s)
    timeout -k 10 "$limit" "$@" >"$logs/$name.log" 2>&1
    local rc=$?
    echo "$name: rc=$rc in $(( $(date +%s) - start ))s (limit ${limit}s): $(tail -n 1 "$logs/$name.log")" >>"$summary"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $py -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name())"
} >"$summary" 2>&1

run_tests() {
    local files=${TESTS:-$(grep -rlE "mark\.cuda|marks=pytest\.mark\.cuda" tests --include='test_*.py' | sort)}
    export -f step left; export logs summary deadline py
    # test_cuda_path.py first: it is the longest.
    printf '%s\n' $(echo "$files" | grep cuda_path) $(echo "$files" | grep -v cuda_path) |
        xargs -P 3 -I{} bash -c 'name=test-$(basename {} .py); step "$name" 300 \
            $py -m pytest -m cuda -q -p no:cacheprovider -o addopts= {} --junitxml="$logs/$name.xml"'
    touch "$logs/tests.done"
}

bench() {
    case $1 in
        capture-L1) step "$1" 150 $py benchmarks/cuda_capture.py --level 1 --json "$logs/$1.json" ;;
        capture-L2) step "$1" 200 $py benchmarks/cuda_capture.py --level 2 --json "$logs/$1.json" ;;
        capture-L1-largest) step "$1" 90 $py benchmarks/cuda_capture.py --level 1 --largest-only \
            --json "$logs/$1.json" ;;
        capture-L1-profile) step "$1" 150 $py benchmarks/cuda_capture.py --level 1 --profile ;;
        kernels-L2-frozen) step "$1" 150 $py benchmarks/cuda_kernels.py --level 2 --frozen --batches 1,32 ;;
        kernels-L*) step "$1" 150 $py benchmarks/cuda_kernels.py --level "${1#kernels-L}" --batches 1,32 ;;
        race) step "$1" 330 $py benchmarks/cuda_race.py --wait "$logs/tests.done" --wait-s 240 --json "$logs/$1.json" ;;
        skinny) step "$1" 150 $py benchmarks/cuda_skinny_mm.py --rows 1,4,16 --json "$logs/$1.json" ;;
        bench-*) step "$1" 200 $py -m graphopt bench --device cuda --workloads decoder --no-startup \
            --rounds 5 --contenders "eager,${1#bench-}" --out "$logs/$1" --wide ;;
        *) echo "$1: no such benchmark" >>"$summary" ;;
    esac
}

# "all": the tests beside the benchmarks (they slow a launch-bound eager row a little;
# on a lease of minutes, one after the other leaves the last benchmarks no time).
[[ $phase == tests || $phase == all ]] && { if [[ $phase == all ]]; then run_tests & else run_tests; fi; }
[[ $phase == bench ]] && touch "$logs/tests.done"  # no tests for the race to wait for
if [[ $phase == bench || $phase == all ]]; then
    for name in ${BENCH:-race capture-L1 kernels-L2-frozen bench-L2+frozen+graphs bench-compile-ro \
                           bench-L1+graphs capture-L2}; do
        bench "$name"
    done
fi
wait

cp "$summary" "$out/summary.txt"
tar czf "$out/results.tgz" -C "$logs" .
cat "$summary"
