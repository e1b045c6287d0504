#!/usr/bin/env bash
# Set up a development environment from this repository's own files:
#   - Debian's Prometheus, Alertmanager and promtool (integration tests run them on loopback),
#   - Debian's Chromium (the console's browser tests drive it headless through Playwright; nothing
#     downloads a browser),
#   - Debian's PostgreSQL server binaries (the PostgreSQL store's tests start a private cluster),
#   - a virtual environment in .venv with trainguard, its extras for the agent, the controller, the dashboards, the
#     framework integrations (Hugging Face, Lightning) and PostgreSQL, and the test tools, at the exact versions of
#     constraints.txt.
# Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v prometheus >/dev/null 2>&1 || need_apt+=(prometheus)
command -v promtool >/dev/null 2>&1 || need_apt+=(prometheus)
command -v prometheus-alertmanager >/dev/null 2>&1 || need_apt+=(prometheus-alertmanager)
[ -x /usr/bin/chromium ] || need_apt+=(chromium)
# Debian's PostgreSQL server binaries (initdb, pg_ctl): the PostgreSQL store's tests start a private cluster
compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null && compgen -G '/usr/lib/postgresql/*/bin/pg_ctl' >/dev/null || need_apt+=(postgresql)
if [ "${#need_apt[@]}" -gt 0 ] && [ "${TRAINGUARD_SKIP_APT:-0}" != "1" ]; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
        prometheus prometheus-alertmanager chromium postgresql >/dev/null
fi
# Debian's packages start the daemons where systemd runs; the tests start their own instances on
# free loopback ports, so a system instance is never needed.

PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if ! .venv/bin/python -m pip install -q -c constraints.txt -e '.[dev,hf,lightning,postgres]' >.venv/pip-install.log 2>&1; then
    cat .venv/pip-install.log
    exit 1
fi
.venv/bin/python -c "import torch, fastapi, prometheus_client, grafanalib; print('trainguard env ready: torch', torch.__version__)"
