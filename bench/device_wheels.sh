#!/usr/bin/env bash
# Downloads into .wheels/ the wheels of the project's dependencies that a bare GPU image lacks (its
# Python holds torch, numpy, pytest, httpx, prometheus-client, PyYAML, anyio, h11, click, uvloop,
# nvidia-ml-py, but not pydantic nor the controller's FastAPI stack), at the versions constraints.txt
# pins, for that image's Python (DEVICE_PYTHON_VERSION, default 3.12) on x86-64 Linux. Run it
# where pip reaches the network; bench/device_check.sh installs them there without the network.
# .wheels/ is git-ignored: a copy of the checkout that takes ignored paths only when named (a
# device machine's) must be given it.
#
#   bash bench/device_wheels.sh
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-}
[ -z "$PY" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
[ -z "$PY" ] && PY=python3
VERSION=${DEVICE_PYTHON_VERSION:-3.12}
NAMES="pydantic pydantic_core annotated-types typing-inspection typing_extensions fastapi starlette annotated-doc
opentelemetry-api uvicorn httptools pydantic-settings python-dotenv"
pins=()
for name in $NAMES; do
    pin=$(grep -i -m1 -E "^${name//[-_]/[-_]}==" constraints.txt) || { echo "device_wheels: $name is not pinned in constraints.txt" >&2; exit 1; }
    pins+=("$pin")
done
platforms=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64 manylinux_2_34_x86_64; do
    platforms+=(--platform "$p")
done
rm -rf .wheels
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$VERSION" --implementation cp \
    "${platforms[@]}" -d .wheels "${pins[@]}"
ls .wheels
du -sh .wheels
