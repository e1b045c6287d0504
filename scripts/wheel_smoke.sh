#!/usr/bin/env bash
# The built artifacts are the tested artifacts: build trainguard's sdist and wheel, install them
# into fresh virtual environments with only the extras a user would pick, and smoke-test each from
# outside the checkout (scripts/wheel_smoke.py says what is checked), then `pip check` it.
#
#   bash scripts/wheel_smoke.sh            (after scripts/setup.sh: it builds with .venv's `build`)
#
# Extras sets: agent; service (installed from the sdist); agent,hf; agent,lightning;
# service,dashboards. Each set gets its own new environment (no system site-packages), installed
# with -c constraints.txt (the project's exact versions; pip's cache is reused), two at a time.
# Every import statement in the README's code blocks must run in at least one of them.
# Exit status 0 when every set passed; a failing set's install or smoke log is printed.
# WHEEL_SMOKE_JOBS (default 2) sets how many environments are made at once.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
started=$SECONDS
BUILD_PY="$ROOT/.venv/bin/python"
# the interpreter .venv was made from: the environments below use the same Python
BASE_PY="$("$BUILD_PY" -c 'import sys; print(sys._base_executable)')"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/trainguard-wheel-smoke.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
# The environments see nothing of the checkout's: no PYTHONPATH, no controller settings.
unset PYTHONPATH
while read -r var; do unset "$var"; done < <(env | sed -n 's/^\(TRAINGUARD_[A-Za-z0-9_]*\)=.*/\1/p')
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# Build from a copy of what a build reads, so no build/ or *.egg-info lands in the checkout. The
# wheel is built from the sdist (python -m build's default), so the sdist is complete too.
mkdir -p "$WORK/src"
cp -r pyproject.toml README.md LICENSE trainguard trainer_agent service dashboards "$WORK/src/"
find "$WORK/src" -name __pycache__ -prune -exec rm -rf {} +
if ! "$BUILD_PY" -m build --outdir "$WORK/dist" "$WORK/src" >"$WORK/build.log" 2>&1; then
    cat "$WORK/build.log"
    exit 1
fi
wheel="$(ls "$WORK"/dist/trainguard-*.whl)"
sdist="$(ls "$WORK"/dist/trainguard-*.tar.gz)"
cp scripts/wheel_smoke.py "$WORK/wheel_smoke.py"
echo "built $(basename "$sdist") and $(basename "$wheel") in $((SECONDS - started)) s"

# smoke_set NAME EXTRAS ARTIFACT: a fresh environment with ARTIFACT[EXTRAS], pip check, smoke test
smoke_set() {
    local name="$1" extras="$2" artifact="$3" env="$WORK/env-$1" log="$WORK/$1.log" t0=$SECONDS
    if smoke_steps "$name" "$extras" "$artifact" "$env" >"$log" 2>&1; then
        echo "passed: [$extras] from $(basename "$artifact") ($((SECONDS - t0)) s: $(grep '^+ ' "$log" | tr '\n' ' '))"
        rm -rf "$env"
    else
        echo "FAILED: [$extras] from $(basename "$artifact") ($((SECONDS - t0)) s):"
        grep -v "is ignored: it is neither a file nor a directory" "$log"
        return 1
    fi
}

# (each step checked by hand: `set -e` does not act inside a function whose status is tested)
smoke_steps() {
    local name="$1" extras="$2" artifact="$3" env="$4" t=$SECONDS
    "$BASE_PY" -m venv "$env" || return 1
    "$env/bin/python" -m pip install -q --no-compile -c "$ROOT/constraints.txt" "${artifact}[${extras}]" || return 1
    echo "+ install $((SECONDS - t)) s"
    "$env/bin/python" -m pip check || return 1
    mkdir -p "$WORK/run-$name" && cd "$WORK/run-$name" || return 1
    t=$SECONDS
    "$env/bin/python" "$WORK/wheel_smoke.py" --extras "$extras" --readme "$ROOT/README.md" \
        --covered "$WORK/covered-$name.txt" || return 1
    echo "+ pip check and smoke $((SECONDS - t)) s"
}

# name extras artifact; the torch environments first (the longest installs)
sets=(
    "agent-hf agent,hf $wheel"
    "agent-lightning agent,lightning $wheel"
    "agent agent $wheel"
    "service service $sdist"
    "service-dashboards service,dashboards $wheel"
)
failed=0
running=0
for entry in "${sets[@]}"; do
    read -r name extras artifact <<<"$entry"
    # WHEEL_SMOKE_SETS="agent-hf service" runs only those (while working on one; CI runs all)
    if [ -n "${WHEEL_SMOKE_SETS:-}" ] && [[ " $WHEEL_SMOKE_SETS " != *" $name "* ]]; then
        continue
    fi
    if [ "$running" -ge "${WHEEL_SMOKE_JOBS:-2}" ]; then
        wait -n || failed=1
        running=$((running - 1))
    fi
    smoke_set "$name" "$extras" "$artifact" &
    running=$((running + 1))
done
while [ "$running" -gt 0 ]; do
    wait -n || failed=1
    running=$((running - 1))
done

# Every import statement of the README ran in at least one environment.
[ -z "${WHEEL_SMOKE_SETS:-}" ] || { echo "wheel smoke of ${WHEEL_SMOKE_SETS}: $([ "$failed" -eq 0 ] && echo passed || echo FAILED)"; exit "$failed"; }
missing="$("$BUILD_PY" scripts/wheel_smoke.py --list-readme-imports --readme README.md \
           | grep -vxF -f <(cat "$WORK"/covered-*.txt 2>/dev/null) || true)"
if [ -n "$missing" ]; then
    echo "README imports that ran in no smoke environment (which extras set installs what they need?):"
    echo "$missing"
    failed=1
fi
echo "wheel smoke: $([ "$failed" -eq 0 ] && echo passed || echo FAILED) in $((SECONDS - started)) s"
exit "$failed"
