#!/usr/bin/env bash
# The checks that need a GPU, in one run of at most ~8 minutes on one device, ending in one table:
#   1. the CUDA tests (every test skipped without a GPU),
#   2. the agent's overhead on a GPT-like model (default configuration and every metric every step),
#   3. FSDP2 on one rank (NCCL, a world of one) with the agent: its gradient norms against
#      clip_grad_norm_'s and its share of the step (bench/fsdp2_one_rank.py),
#   4. the agent's operators and CUDA kernel launches per step and per report step against the
#      tensor count (bench/agent_scale.py), alone and under DDP with gradient_as_bucket_view (one
#      rank), and the fingerprint projections' (bench/fingerprint_projection.py),
#   5. the reaction latency of the closed loop (controller + 2 gloo ranks; CPU-side, here for one table).
# Each part has its own time limit, cut to what is left of DEVICE_CHECK_BUDGET_S (default 450 s, setup included);
# a part that fails or runs out of time is marked and the rest go on. Each part's log and the
# table (summary.txt) are written to $OUT (8 files at most). On a machine without CUDA it says so
# and exits 0.
#
#   bash bench/device_check.sh         # from anywhere; the interpreter: $PYTHON, else .venv/bin/python, else python3
#   bash bench/device_check.sh --cpu   # a rehearsal on the CPU: every part, small sizes, the CUDA tests skipped
#
# What it needs: a Python with torch (CUDA build), numpy, pytest, httpx, prometheus-client, PyYAML,
# and the project's other dependencies: pydantic, fastapi, uvicorn, httptools, pydantic-settings
# (bench/device_wheels.sh downloads the wheels of those a bare GPU image lacks into .wheels/; where
# an import fails and .wheels/ holds wheels, they are installed into that Python's environment
# without the network). It runs from the checkout itself (no install): the repository goes on
# PYTHONPATH, trainguard/service and trainguard/dashboards are linked where the checkout lacks them,
# and a `trainguard` command is written beside the interpreter where there is none (the controller
# tests and the reaction latency start `trainguard serve` from there).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
START=$SECONDS  # the budget counts from here: the setup too
MODE=cuda
[ "${1:-}" = "--cpu" ] && MODE=cpu
BUDGET=${DEVICE_CHECK_BUDGET_S:-450}
PY=${PYTHON:-}
[ -z "$PY" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
[ -z "$PY" ] && PY=python3
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Every process group here lives on this machine: loopback, whatever the machine's name resolves to
# (a machine without a network may resolve it to nothing, and NCCL passes over lo unless told).
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo} NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
MODULES="torch numpy pydantic httpx prometheus_client yaml pytest fastapi uvicorn httptools pydantic_settings"

missing() {  # the modules of MODULES this Python cannot import
    "$PY" -c 'import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))' $MODULES 2>/dev/null || echo "$MODULES"
}

prepare() {  # the interpreter's dependencies, the checkout's package links, the trainguard command
    local lacking script
    lacking=$(missing)
    if [ -n "$lacking" ] && compgen -G ".wheels/*.whl" >/dev/null; then
        echo "device_check: $PY lacks $lacking: installing .wheels/*.whl (no network, no dependencies)"
        timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .wheels/*.whl 2>&1 \
            | tail -n 3 || timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --break-system-packages .wheels/*.whl 2>&1 | tail -n 3  # (a Python its distribution manages: PEP 668)
        lacking=$(missing)
    fi
    [ -n "$lacking" ] && echo "device_check: $PY cannot import: $lacking (run bench/device_wheels.sh where pip" \
        "reaches the network and bring .wheels/ along); the parts that need them will fail"
    for pkg in service dashboards; do
        if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('trainguard.$pkg') is None)" 2>/dev/null \
            && [ ! -e "trainguard/$pkg" ]; then
            ln -s "../$pkg" "trainguard/$pkg" && echo "device_check: linked trainguard/$pkg -> ../$pkg (no install here)"
        fi
    done
    script=$("$PY" -c 'import pathlib, sys; print(pathlib.Path(sys.executable).with_name("trainguard"))' 2>/dev/null)
    if [ -n "$script" ] && [ ! -e "$script" ]; then
        if printf '#!/bin/sh\nexec "%s" -m trainguard.cli "$@"\n' "$("$PY" -c 'import sys; print(sys.executable)')" \
            >"$script" 2>/dev/null && chmod +x "$script"; then
            echo "device_check: wrote $script (python -m trainguard.cli)"
        else
            echo "device_check: no trainguard command beside $PY and none can be written there:" \
                "the controller tests and the reaction latency will fail"
        fi
    fi
}

if [ "$MODE" = cuda ]; then
    if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
        echo "device_check: no CUDA device on this machine (torch.cuda.is_available() is False, or $PY has no torch): nothing to check."
        echo "device_check: run it where a GPU is lent (bash bench/device_check.sh --cpu rehearses it on the CPU);" \
            "every test and benchmark of the suite runs on the CPU."
        exit 0
    fi
    timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader 2>&1 | head -n 4
fi
prepare
"$PY" -c 'import sys, torch; print("device_check:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU",
    "| torch", torch.__version__, "| CUDA", torch.version.cuda, "| Python", sys.version.split()[0])'

if [ "$MODE" = cuda ]; then
    DEV=cuda TENSORS="100 1000 5000" ELEMENTS=4000000
    OVERHEAD=(--steps 12 --warmup 2) FSDP2=() LATENCY=(--trials 3 --rounds 2 --steps 20)
else  # the same parts at sizes the CPU gets through in a few minutes
    DEV=cpu TENSORS="100 1000" ELEMENTS=200000
    OVERHEAD=(--steps 4 --warmup 1 --d-model 128 --layers 2 --batch 4 --seq 32)
    FSDP2=(--width 64 --blocks 3 --steps 12) LATENCY=(--trials 1 --rounds 1 --steps 5)
fi

rows=()
part() {  # part NAME LIMIT_S SUMMARY_REGEX -- command...: run it under min(LIMIT_S, what is left of BUDGET)
    local name=$1 limit=$2 pattern=$3; shift 4
    local log="$OUT/${name// /_}.log" start=$SECONDS rc status line first left=$((BUDGET - (SECONDS - START)))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 10 ]; then
        rows+=("$(printf '%-22s | %-16s | %4d s | %s' "$name" "not run (budget)" 0 "")")
        return
    fi
    echo "== $name (limit ${limit} s)"
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
    rc=$?
    tail -n 25 "$log"
    status=ok
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then status="timed out"; elif [ $rc -ne 0 ]; then status="failed (rc $rc)"; fi
    rows+=("$(printf '%-22s | %-16s | %4d s | ' "$name" "$status" $((SECONDS - start)))")
    first=1
    while IFS= read -r line; do  # its last 4 lines of figures, one a table line
        [ $first -eq 1 ] && rows[-1]+=$line || rows+=("$(printf '%-22s | %-16s | %6s | %s' "" "" "" "$line")")
        first=0
    done < <(grep -E "$pattern" "$log" | tail -n 4 | tr -s ' ' | cut -c1-200)
}

# TENSORS unquoted: one argument per size
part "cuda tests" 120 "^FAILED |^ERROR | passed| failed| error" -- \
    "$PY" -m pytest -q -p no:cacheprovider -o timeout=100 \
    tests/agent/test_agent_cuda.py tests/control/test_control_cuda.py tests/data/test_data_cuda.py \
    "tests/agent/test_staged.py::test_staged_passes_on_cuda_match_the_fused_ones"

part "agent overhead" 90 "^configuration |^default |^every metric " -- \
    "$PY" bench/agent_overhead.py --device "$DEV" "${OVERHEAD[@]}"

part "fsdp2 one rank" 45 "^fsdp2" -- "$PY" bench/fsdp2_one_rank.py --device "$DEV" "${FSDP2[@]}"

part "ops and kernels" 90 "^tensors |^[0-9,]+ \|" -- \
    "$PY" bench/agent_scale.py --device "$DEV" --tensors $TENSORS --rounds 1 --elements "$ELEMENTS"

part "ddp bucket kernels" 45 "^tensors |^[0-9,]+ \|" -- \
    "$PY" bench/agent_scale.py --device "$DEV" --ddp --bucket-view --tensors ${TENSORS%% *} ${TENSORS##* } \
    --rounds 1 --elements "$ELEMENTS"

part "fingerprint kernels" 30 "^tensors |^[0-9,]+ \|" -- \
    "$PY" bench/fingerprint_projection.py --device "$DEV" --tensors $TENSORS --rounds 3 --elements "$ELEMENTS"

part "reaction latency" 75 "^median|not paused" -- "$PY" bench/reaction_latency.py "${LATENCY[@]}"

{
    echo "device_check summary ($MODE; logs in $OUT)"
    printf '%-22s | %-16s | %6s | %s\n' "part" "status" "time" "figures"
    for r in "${rows[@]}"; do echo "$r"; done
} | tee "$OUT/summary.txt"
