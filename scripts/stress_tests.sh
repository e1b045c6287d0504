#!/usr/bin/env bash
# Run the distributed, integration and timing tests N times in a row while a CPU-heavy training
# loop (torch, one thread per core) runs beside them; print each run's outcome and wall time and
# the pass count. A suite that only passes on an idle machine fails here.
#
#   scripts/stress_tests.sh [N=20] [extra pytest arguments...]
#   BURNER=0 scripts/stress_tests.sh 3        # the same without the CPU burner
#   STRESS_LOG_DIR=/tmp/stress scripts/stress_tests.sh 5 tests/control
#   STRESS_MARKS= BURNER_NICE=19 scripts/stress_tests.sh 10   # the whole suite, the burner yielding
#
# STRESS_MARKS selects tests by marker (default: the distributed, integration and timing tests;
# empty: every test, as the README's command runs them). BURNER_NICE runs the burner at that
# niceness (default 0: it takes its share of both cores).
# Each run's pytest output goes to $STRESS_LOG_DIR/run-<i>.log (default: a new temporary folder).
# Exit status: 0 when every run passed.
set -uo pipefail
cd "$(dirname "$0")/.."
N=${1:-20}
shift $(( $# > 0 ? 1 : 0 ))
PY=${PYTHON:-.venv/bin/python}
LOG_DIR=${STRESS_LOG_DIR:-$(mktemp -d /tmp/trainguard-stress.XXXXXX)}
mkdir -p "$LOG_DIR"
MARKS=${STRESS_MARKS-distributed or integration or timing}

burner_pid=""
stop_burner() {
    if [[ -n "$burner_pid" ]]; then
        kill "$burner_pid" 2>/dev/null
        wait "$burner_pid" 2>/dev/null
    fi
}
trap stop_burner EXIT

if [[ "${BURNER:-1}" != "0" ]]; then
    # A training loop on every core: an MLP on random data, as another job on the machine would be.
    nice -n "${BURNER_NICE:-0}" "$PY" - >"$LOG_DIR/burner.log" 2>&1 <<'EOF' &
import os, torch
torch.set_num_threads(os.cpu_count() or 1)
model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1024))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
steps = 0
while True:
    loss = model(torch.randn(256, 1024)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    steps += 1
    if steps % 500 == 0:
        print("burner steps", steps, flush=True)
EOF
    burner_pid=$!
    echo "CPU burner: pid $burner_pid ($(nproc) threads)"
fi

echo "code: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)'); $(nproc) cores; $("$PY" -c 'import torch, sys; print(f"python {sys.version.split()[0]}, torch {torch.__version__}")')"
echo "selection: ${MARKS:+-m '$MARKS' }${*:-every test}; $N runs; logs in $LOG_DIR"
passed=0
total_start=$(date +%s)
for i in $(seq 1 "$N"); do
    start=$(date +%s)
    marks=()
    [[ -n "$MARKS" ]] && marks=(-m "$MARKS")
    timeout "${STRESS_RUN_TIMEOUT:-1800}" "$PY" -m pytest -q -p no:cacheprovider "${marks[@]}" "$@" >"$LOG_DIR/run-$i.log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - start ))
    summary=$(grep -E "^(=+ )?[0-9]+ (passed|failed)|^[0-9]+ (passed|failed|error)" "$LOG_DIR/run-$i.log" | tail -1)
    load=$(cut -d' ' -f1 /proc/loadavg)
    if [[ $rc -eq 0 ]]; then
        passed=$((passed + 1))
        echo "run $i: PASS in ${secs}s (load ${load}): ${summary}"
    else
        echo "run $i: FAIL (exit $rc) in ${secs}s (load ${load}): ${summary}"
        grep -E "^(FAILED|ERROR) " "$LOG_DIR/run-$i.log" | sed 's/^/    /'
    fi
done
echo "passed $passed of $N runs in $(( $(date +%s) - total_start ))s (logs: $LOG_DIR)"
[[ $passed -eq $N ]]
