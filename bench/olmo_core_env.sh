#!/usr/bin/env bash
# Installs OLMo-core (PyPI ai2-olmo-core) for bench/recovery.py's OLMo column only, into a directory
# of its own (default: .bench-olmo/ beside the repo root), never into the project's environment.
#
# Why not `pip install -c constraints.txt ai2-olmo-core`: ai2-olmo-core 3.0.0 accepts torch 2.13, but it
# (and cached-path, which it imports) requires filelock<4.0, while constraints.txt pins filelock==4.3.1,
# so the install cannot resolve. Here every package is installed with --no-deps at a pinned version:
# OLMo-core itself, and the packages that `import olmo_core.optim` really imports and the venv lacks
# (olmo_core.config and olmo_core.io import cached_path at module top, and cached_path imports its S3,
# GCS and Hugging Face clients eagerly: boto3, google-cloud-storage and what they import). Everything
# the venv already has (torch, numpy, filelock 4.3.1, requests, rich, pyyaml, huggingface_hub, ...) is
# used from the venv; the script checks that nothing in the target shadows a venv package, and
# ends by importing SkipStepAdamW the way the bench does (the directory appended to sys.path).
#
#     bash bench/olmo_core_env.sh [TARGET_DIR]      # then: .venv/bin/python bench/recovery.py
#
# PYTHON overrides the interpreter (default: .venv/bin/python). The target is recreated each run.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
target="${1:-$root/.bench-olmo}"
py="${PYTHON:-$root/.venv/bin/python}"

pkgs=(
  ai2-olmo-core==3.0.0
  # olmo_core's own runtime imports the venv lacks
  cached-path==1.8.10
  dataclass-extensions==0.5.0
  bettermap==1.3.1
  dill==0.4.1
  # cached_path.schemes imports these at module top (S3/R2 and GCS clients)
  boto3==1.44.8
  botocore==1.44.8
  s3transfer==0.19.3
  jmespath==1.1.0
  python-dateutil==4.0.0
  google-cloud-storage==3.17.1
  google-cloud-core==2.8.0
  google-api-core==2.44.0
  google-auth==2.63.0
  google-resumable-media==2.11.0
  googleapis-common-protos==1.76.0
  protobuf==7.36.2
  cryptography==50.0.2
  cffi==2.1.1
)

rm -rf "$target"
"$py" -m pip install --quiet --no-deps --no-warn-script-location --target "$target" "${pkgs[@]}"
rm -rf "$target/bin"  # console scripts; the bench needs none

# Remove from the target any distribution the venv already has (the venv's version is the one used).
"$py" - "$target" <<'EOF'
import importlib.metadata as md
import shutil
import sys
from pathlib import Path

target = Path(sys.argv[1]).resolve()
venv_path = [p for p in sys.path if Path(p or ".").resolve() != target]
venv = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in md.distributions(path=venv_path)}
for dist in md.distributions(path=[str(target)]):
    name = dist.metadata["Name"].lower().replace("_", "-")
    if name in venv:
        print(f"olmo_core_env: {name} {dist.version} is in the venv already ({venv[name]}); removed from {target}")
        for f in dist.files or []:
            p = (target / f).resolve()
            if p.is_file() and target in p.parents:
                p.unlink()
        shutil.rmtree(Path(dist._path), ignore_errors=True)  # its .dist-info
# And any top-level module in the target that the venv can import by itself.
import importlib.util
sys.path[:] = venv_path
for entry in sorted(target.iterdir()):
    if entry.name.endswith((".dist-info", ".libs")) or entry.name.startswith(("_", ".")):
        continue
    mod = entry.name.split(".")[0]
    spec = importlib.util.find_spec(mod)
    if spec is not None and mod != "google":  # google is a namespace package shared by several dists
        sys.exit(f"olmo_core_env: {mod} in {target} shadows the venv's {spec.origin}")
EOF

cd /tmp && "$py" -c "
import sys
sys.path.append(sys.argv[1])
from olmo_core.optim import SkipStepAdamW
import importlib.metadata as md
print('olmo_core_env: ai2-olmo-core', md.version('ai2-olmo-core'), 'in', sys.argv[1], '->', SkipStepAdamW.__module__ + '.' + SkipStepAdamW.__name__)
" "$target"
