#!/usr/bin/env bash
# `make test` N times in a row (default 3) beside a CPU hog: one busy process per core, so the
# suite runs on a machine whose cores are all taken by other work. The hog's processes are
# started here and killed by their PIDs when this script ends, however it ends.
#
#   scripts/test-under-load.sh [RUNS]                 (make test-under-load: make test, 3 runs)
#   scripts/test-under-load.sh RUNS PYTEST_ARGS...    (those tests only, e.g. one file)
#
# Prints each run's result and wall time; exits non-zero if any run failed.
set -u
cd "$(dirname "$0")/.."
runs=${1:-3}
shift $(( $# > 0 ? 1 : 0 ))
if [ $# -gt 0 ]; then
    what=("${PY:-.venv/bin/python}" -m pytest -q -p no:cacheprovider "$@")  # PY: another interpreter
else
    what=(make test)
fi
cores=$(nproc)
hogs=()

stop_hogs() {
    for pid in "${hogs[@]}"; do
        kill "$pid" 2>/dev/null
    done
    for pid in "${hogs[@]}"; do
        wait "$pid" 2>/dev/null
    done
    hogs=()
}
trap stop_hogs EXIT
trap 'exit 130' INT TERM

for _ in $(seq "$cores"); do
    # a busy loop of the shell itself: no child to leave behind
    ( trap 'exit 0' TERM; while :; do :; done ) &
    hogs+=("$!")
done
echo "CPU hog: ${#hogs[@]} busy processes (PIDs ${hogs[*]}) on $cores cores; running: ${what[*]}"

failed=0
for run in $(seq "$runs"); do
    started=$(date +%s)
    if "${what[@]}"; then result=passed; else result=FAILED; failed=$((failed + 1)); fi
    echo "run $run of $runs: $result in $(( $(date +%s) - started )) s (beside the CPU hog)"
done
stop_hogs
echo "$((runs - failed)) of $runs runs passed beside a CPU hog of $cores busy processes"
[ "$failed" -eq 0 ]
