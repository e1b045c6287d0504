"""Extract the ``openAPIV3Schema`` of each served version of CustomResourceDefinitions into
``<Kind>.<version>.json`` beside this file (the schemas the chart's tests validate the rendered
Prometheus Operator objects with; README.md says where they come from).

    python deploy/helm/schemas/extract_crd_schemas.py CRD.yaml [CRD.yaml ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent


class _CrdLoader(yaml.SafeLoader):
    """YAML 1.1's ``=`` "value" tag off: the CRDs list ``=`` as an enum member (a matcher type)."""


_CrdLoader.yaml_implicit_resolvers = {
    first: [r for r in resolvers if r[0] != "tag:yaml.org,2002:value"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def extract(crd_text: str) -> dict[str, dict]:
    """File name -> schema, for every served version of the CRD in ``crd_text``."""
    crd = yaml.load(crd_text, _CrdLoader)
    if crd.get("kind") != "CustomResourceDefinition":
        raise ValueError(f"not a CustomResourceDefinition: kind {crd.get('kind')!r}")
    kind = crd["spec"]["names"]["kind"]
    return {f"{kind}.{v['name']}.json": v["schema"]["openAPIV3Schema"]
            for v in crd["spec"]["versions"] if v.get("served")}


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    for path in paths:
        for name, schema in extract(Path(path).read_text(encoding="utf-8")).items():
            (HERE / name).write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n", encoding="utf-8")
            print(f"wrote {HERE / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
