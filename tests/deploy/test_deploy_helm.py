"""The Helm chart under deploy/helm/trainguard, rendered offline by Helm's own engine (Helm's Go SDK,
through the ``helm-python-sdk`` package) with its default values and with each switch off and on.
Every rendered object is validated: the core kinds with ``kubernetes-validate`` (the Kubernetes
OpenAPI schemas, strict: unknown fields are errors), the Prometheus Operator's kinds with the
operator's published CRD schemas (deploy/helm/schemas/, strict as well). The chart's alert rules and
dashboards are the generated files; the PodMonitor selects the pods of the worked example
deploy/examples/pytorchjob.yaml."""

from __future__ import annotations

import base64
import copy
import functools
import json
import re
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from deploy.helm import chart_files
from trainguard.dashboards import build
from trainguard.protocol.catalog import BASE_LABELS
from trainguard.service.auth import OPERATOR_SCOPES, TokenTable
from trainguard.service.config import Settings
from trainguard.service.routes.system import router as system_router

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy/helm/trainguard"
SCHEMAS = ROOT / "deploy/helm/schemas"
EXAMPLE = ROOT / "deploy/examples/pytorchjob.yaml"
GENERATED = build.GENERATED
#: Kubernetes releases the core kinds are validated against: the oldest the chart supports
#: (Chart.yaml's kubeVersion) and the newest kubernetes-validate knows.
KUBE_VERSIONS = ("1.25.0", kubernetes_validate.latest_version())
RELEASE, NAMESPACE = "tg", "ml-platform"
SWITCHES = ("serviceMonitor", "podMonitor", "prometheusRule", "grafanaDashboards", "alertmanagerConfig")
#: The kind each switch adds.
SWITCH_KINDS = {"serviceMonitor": "ServiceMonitor", "podMonitor": "PodMonitor", "prometheusRule": "PrometheusRule",
                "grafanaDashboards": "ConfigMap", "alertmanagerConfig": "AlertmanagerConfig"}
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's: the dashboards are 200 kB of YAML


# -- rendering and validation ------------------------------------------------------------------
@functools.cache
def _chart() -> helm_python.Chart:
    return helm_python.Chart.load(CHART)


def render_templates(values: dict | None = None, *, name: str = RELEASE, namespace: str = NAMESPACE,
                     chart: helm_python.Chart | None = None) -> dict[str, str]:
    """Template path -> rendered text, as ``helm template`` renders them (``lookup`` finds nothing)."""
    return (chart or _chart()).render(values or {}, name=name, namespace=namespace, is_install=True)


def render(values: dict | None = None, **kwargs) -> list[dict]:
    """The rendered objects."""
    objects = []
    for path, text in render_templates(values, **kwargs).items():
        if path.endswith(".yaml"):
            objects += [o for o in yaml.load_all(text, _LOADER) if o is not None]
    return objects


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict], kind: str) -> dict:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"{len(found)} objects of kind {kind}"
    return found[0]


def _closed(schema: object) -> object:
    """The schema with every object that lists its properties closed to others (what the API
    server's strict field validation does with unknown fields), except where the schema keeps
    unknown fields itself (``x-kubernetes-preserve-unknown-fields``)."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@functools.cache
def _crd_validator(api_version: str, kind: str) -> jsonschema.Validator:
    version = api_version.split("/")[1]
    schema = _closed(json.loads((SCHEMAS / f"{kind}.{version}.json").read_text()))
    return jsonschema.Draft7Validator(schema)


def validate(obj: dict) -> None:
    """Raises AssertionError naming the object and every schema violation."""
    _validate_json(json.dumps(obj, sort_keys=True))


@functools.cache
def _validate_json(text: str) -> None:
    """:func:`validate`, once per distinct object (most renders repeat most objects)."""
    obj = json.loads(text)
    name = f"{obj.get('kind')} {obj.get('metadata', {}).get('name')}"
    meta = obj["metadata"]
    assert _DNS_LABEL.match(meta["name"]) and len(meta["name"]) <= 63, f"{name}: bad name"
    for key, value in (meta.get("labels") or {}).items():
        assert isinstance(value, str) and len(value) <= 63 and _LABEL_VALUE.match(value), f"{name}: label {key}={value!r}"
    if obj["apiVersion"].startswith("monitoring.coreos.com/"):
        errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                  for e in _crd_validator(obj["apiVersion"], obj["kind"]).iter_errors(obj)]
        assert not errors, f"{name}:\n" + "\n".join(errors)
        return
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            raise AssertionError(f"{name} (Kubernetes {version}): {e.message} at {list(e.absolute_path)}") from None


@pytest.fixture(scope="module")
def default_objects() -> list[dict]:
    return render()


# -- the chart's files are the generated ones ------------------------------------------------------
def test_chart_files_are_what_the_generator_writes():
    rendered = chart_files.render()
    assert build.stale_files(chart_files.FILES, rendered) == [], \
        "run `python -m deploy.helm.chart_files` and commit the result"
    # The chart ships what its folder holds (``.Files.Glob``): nothing there but the generator's files.
    present = {p.relative_to(chart_files.FILES).as_posix() for p in chart_files.FILES.rglob("*") if p.is_file()}
    assert present == set(rendered) | {build.MANIFEST}


def test_generator_check_mode_reports_drift_and_writing_repairs_it(tmp_path, capsys):
    assert chart_files.main(["--out", str(tmp_path)]) == 0
    (tmp_path / "prometheus/rules.yml").write_text("groups: []\n")
    (tmp_path / "left-over.yaml").write_text("{}\n")  # written by an earlier build, no longer generated
    manifest = tmp_path / build.MANIFEST
    manifest.write_text(manifest.read_text() + "left-over.yaml\n")
    assert chart_files.main(["--out", str(tmp_path), "--check"]) == 1
    err = capsys.readouterr().err
    assert "prometheus/rules.yml" in err and "left-over.yaml" in err
    assert chart_files.main(["--out", str(tmp_path)]) == 0
    assert chart_files.main(["--out", str(tmp_path), "--check"]) == 0
    assert not (tmp_path / "left-over.yaml").exists()


def test_controller_route_refuses_configurations_it_cannot_translate():
    base = {"route": {"receiver": "sink", "routes": [{"receiver": "trainguard-controller", "matchers": ['a=~"x|y"']}]}}
    assert chart_files.controller_route(base) == {"matchers": [{"name": "a", "matchType": "=~", "value": "x|y"}]}
    with pytest.raises(ValueError, match="expected one route"):
        chart_files.controller_route({"route": {"receiver": "sink", "routes": []}})
    bad = copy.deepcopy(base)
    bad["route"]["routes"][0]["matchers"] = ["a =~ x"]
    with pytest.raises(ValueError, match="not of the form"):
        chart_files.controller_route(bad)
    bad["route"]["routes"][0]["matchers"] = []
    with pytest.raises(ValueError, match="every alert"):
        chart_files.controller_route(bad)


def test_prometheusrule_is_the_generated_rules_file(default_objects):
    generated = (GENERATED / "prometheus/rules.yml").read_text()
    rule = one(default_objects, "PrometheusRule")
    assert rule["spec"] == yaml.safe_load(generated)
    # Byte for byte: every line of the file, indented under spec (Helm templated none of its {{ }}).
    text = render_templates()["trainguard/templates/prometheusrule.yaml"]
    body = text[text.index("\nspec:\n") + len("\nspec:\n"):]
    assert [line.removeprefix("  ") for line in body.rstrip().split("\n")] == generated.rstrip().split("\n")
    assert "{{ $labels.run }}" in json.dumps(rule["spec"])


def test_dashboard_configmaps_are_the_generated_dashboards(default_objects):
    generated = {p.name: p.read_text() for p in (GENERATED / "grafana/dashboards").glob("*.json")}
    assert len(generated) == len(build.DASHBOARDS)
    maps = [c for c in by_kind(default_objects, "ConfigMap") if c["metadata"]["labels"].get("grafana_dashboard") == "1"]
    assert {key: text for c in maps for key, text in c["data"].items()} == generated
    assert all(len(c["data"]) == 1 for c in maps)
    assert {c["metadata"]["annotations"]["grafana_folder"] for c in maps} == {"trainguard"}
    assert {c["metadata"]["namespace"] for c in maps} == {NAMESPACE}


def test_a_long_release_name_keeps_the_dashboards_apart():
    """Helm allows release names of up to 53 characters; the dashboards' ConfigMaps keep their own
    names whole (the release's part is shortened), so none replaces another."""
    for name in ("r" * 53, "ml-platform-training-monitoring-release-for-team-x"):
        maps = [c for c in by_kind(render(name=name), "ConfigMap") if "grafana_dashboard" in c["metadata"]["labels"]]
        names = sorted(c["metadata"]["name"] for c in maps)
        assert len(set(names)) == len(build.DASHBOARDS) == len(maps), names
        for c in maps:
            (key,) = c["data"]
            assert c["metadata"]["name"].endswith("-dashboard-" + key.removesuffix(".json")), (key, names)
            validate(c)


def _generated_controller_matcher() -> tuple[str, str]:
    """(label, regex) of the generated Alertmanager configuration's route to the controller."""
    config = yaml.safe_load((GENERATED / "alertmanager/alertmanager.yml").read_text())
    (route,) = [r for r in config["route"]["routes"] if r["receiver"] == "trainguard-controller"]
    (matcher,) = route["matchers"]
    label, _, quoted = matcher.partition("=~")
    return label, quoted.strip('"')


def test_alertmanagerconfig_routes_the_controller_actions_to_the_controller_service(default_objects):
    amc = one(default_objects, "AlertmanagerConfig")
    label, regex = _generated_controller_matcher()
    route = amc["spec"]["route"]
    assert route["matchers"] == [{"name": label, "matchType": "=~", "value": regex}]
    assert route["receiver"] == amc["spec"]["receivers"][0]["name"]
    assert route["groupWait"] == "0s" and route["groupBy"] == ["alertname", "job", "run"]
    # Every generated alert the controller acts on is routed; a notify-only alert is not.
    rules = yaml.safe_load((GENERATED / "prometheus/rules.yml").read_text())
    actions = {r["labels"]["trainguard_action"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    routed = {a for a in actions if re.fullmatch(regex, a)}
    assert routed == actions - {"notify"} and routed
    # The webhook is the controller Service's /v1/alertmanager, with the Alertmanager's token.
    service = one(default_objects, "Service")
    (hook,) = amc["spec"]["receivers"][0]["webhookConfigs"]
    port = service["spec"]["ports"][0]["port"]
    assert hook["url"] == f"http://{service['metadata']['name']}.{NAMESPACE}.svc.cluster.local:{port}/v1/alertmanager"
    assert any(r.path == "/v1/alertmanager" and "POST" in r.methods for r in system_router.routes)
    ref = hook["httpConfig"]["authorization"]["credentials"]
    secret = one(default_objects, "Secret")
    assert ref == {"name": secret["metadata"]["name"], "key": "alertmanager-token"}
    assert hook["sendResolved"] is True


# -- every object validates, with each switch ------------------------------------------------------
def test_default_render_has_every_object_and_each_validates(default_objects):
    kinds = sorted(o["kind"] for o in default_objects)
    assert kinds == sorted(["Secret", "Deployment", "PersistentVolumeClaim", "Service", "ServiceMonitor", "PodMonitor",
                            "PrometheusRule", "AlertmanagerConfig"] + ["ConfigMap"] * len(build.DASHBOARDS))
    for obj in default_objects:
        validate(obj)
    assert {o["metadata"]["namespace"] for o in default_objects} == {NAMESPACE}


@pytest.mark.parametrize("switch", SWITCHES)
def test_each_monitoring_object_switches_off_alone(switch, default_objects):
    objects = render({switch: {"enabled": False}})
    gone = [o for o in default_objects if o["kind"] == SWITCH_KINDS[switch] and
            (switch != "grafanaDashboards" or "grafana_dashboard" in o["metadata"]["labels"])]
    assert gone
    assert sorted((o["kind"], o["metadata"]["name"]) for o in objects) == sorted(
        (o["kind"], o["metadata"]["name"]) for o in default_objects if o not in gone)
    for obj in objects:
        validate(obj)


def test_everything_off_leaves_the_controller_alone():
    objects = render({switch: {"enabled": False} for switch in SWITCHES} | {"persistence": {"enabled": False}})
    assert sorted(o["kind"] for o in objects) == ["Deployment", "Secret", "Service"]
    deployment = one(objects, "Deployment")
    (data,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "data"]
    assert data == {"name": "data", "emptyDir": {}}
    for obj in objects:
        validate(obj)


def test_everything_on_with_every_option_set_validates():
    values = {
        "persistence": {"storageClass": "fast-ssd", "size": "20Gi", "keep": False},
        "controller": {"rules": (ROOT / "service/default_rules.yaml").read_text(),
                       "externalURL": "https://trainguard.example.internal",
                       "env": [{"name": "TRAINGUARD_WINDOW_REPORTS", "value": "256"}],
                       "podLabels": {"team": "ml"}, "podAnnotations": {"a": "b"},
                       "nodeSelector": {"pool": "cpu"}, "priorityClassName": "high"},
        "imagePullSecrets": [{"name": "registry"}],
        "monitoringLabels": {"release": "kube-prometheus-stack"},
        "podMonitor": {"namespaceSelector": {"matchNames": ["training"]}, "localRanksPerPod": 2},
        "grafanaDashboards": {"namespace": "monitoring"},
        "alertmanagerConfig": {"labels": {"alertmanagerConfig": "trainguard"}},
    }
    objects = render(values)
    for obj in objects:
        validate(obj)
    pvc = one(objects, "PersistentVolumeClaim")
    assert pvc["spec"]["storageClassName"] == "fast-ssd" and "annotations" not in pvc["metadata"]
    rules_map = [c for c in by_kind(objects, "ConfigMap") if "rules.yaml" in c["data"]]
    assert rules_map[0]["data"]["rules.yaml"] == values["controller"]["rules"]  # byte for byte
    container = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][-2:] == ["--rules", "/etc/trainguard/rules.yaml"]
    assert {"name": "rules", "mountPath": "/etc/trainguard", "readOnly": True} in container["volumeMounts"]
    for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule"):
        assert one(objects, kind)["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert [e["port"] for e in one(objects, "PodMonitor")["spec"]["podMetricsEndpoints"]] == ["tg-metrics-0", "tg-metrics-1"]
    assert {c["metadata"]["namespace"] for c in by_kind(objects, "ConfigMap") if "grafana_dashboard" in c["metadata"]["labels"]} == {"monitoring"}


@pytest.mark.parametrize(("values", "message"), [
    # A rules mapping would go through Helm's JSON numbers (1e-05 comes back as the string '1e-05').
    ({"controller": {"rules": {"version": 1}}}, "at '/controller/rules': got object, want string"),
    ({"podMonitor": {"enable": False}}, "at '/podMonitor': additional properties 'enable' not allowed"),
    ({"podMonitor": {"localRanksPerPod": 0}}, "at '/podMonitor/localRanksPerPod': minimum: got 0, want 1"),
    ({"serviceMonitor": {"interval": "15 s"}}, "at '/serviceMonitor/interval': '15 s' does not match pattern"),
    ({"persistence": {"enabled": "yes"}}, "at '/persistence/enabled': got string, want boolean"),
    ({"database": {"existingSecret": "pg", "key": ""}}, "at '/database/key': minLength: got 0, want 1"),
])
def test_values_schema_refuses_mistakes_with_the_path(values, message):
    with pytest.raises(helm_python.HelmValuesError, match=re.escape(message)):
        render(values)


def test_existing_claim_and_no_storage_class():
    objects = render({"persistence": {"existingClaim": "trainguard-db"}})
    assert not by_kind(objects, "PersistentVolumeClaim")
    (data,) = [v for v in one(objects, "Deployment")["spec"]["template"]["spec"]["volumes"] if v["name"] == "data"]
    assert data["persistentVolumeClaim"] == {"claimName": "trainguard-db"}
    pvc = one(render({"persistence": {"storageClass": "-"}}), "PersistentVolumeClaim")
    assert pvc["spec"]["storageClassName"] == "" and pvc["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}


# -- the controller's pod ----------------------------------------------------------------------------
def _pod_env(container: dict, secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """The environment Kubernetes gives ``container``: values, secretKeyRef values from ``secrets``
    (name -> key -> value), and $(VAR) references to variables defined before, expanded."""
    env: dict[str, str] = {}
    for var in container["env"]:
        if "value" in var:
            env[var["name"]] = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                                      lambda m: env.get(m[1], m[0]), var["value"])
        elif "secretKeyRef" in var.get("valueFrom", {}):
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = secrets[ref["name"]][ref["key"]]
    return env


def _secret_values(secret: dict) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


def test_the_pods_environment_gives_each_token_its_scope(default_objects):
    secret = one(default_objects, "Secret")
    tokens = _secret_values(secret)
    container = one(default_objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    env = _pod_env(container, {secret["metadata"]["name"]: tokens})
    settings = Settings(host="0.0.0.0", operator_tokens=env["TRAINGUARD_OPERATOR_TOKENS"],
                        agent_tokens=env["TRAINGUARD_AGENT_TOKENS"])
    assert settings.auth_enabled
    table = TokenTable(settings.operator_tokens, settings.agent_tokens)
    scopes = {key: table.authenticate(f"Bearer {tok}") for key, tok in tokens.items()}
    assert scopes["operator-token"].scopes == OPERATOR_SCOPES
    assert scopes["alertmanager-token"].scopes == {"command"}
    assert scopes["agent-token"].kind == "agent"
    assert env["TRAINGUARD_TOKEN"] == tokens["operator-token"]  # what the CLI in the pod reads
    for tok in tokens.values():
        assert re.fullmatch(r"[A-Za-z0-9]{40}", tok)


def test_generated_tokens_differ_and_given_tokens_are_kept():
    first, second = (_secret_values(one(render(), "Secret")) for _ in range(2))
    assert len(set(first.values()) | set(second.values())) == 6
    given = {"operator": "op-token-123", "alertmanager": "am-token-456", "agent": "agent-token-789"}
    kept = _secret_values(one(render({"tokens": given}), "Secret"))
    assert kept == {"operator-token": "op-token-123", "alertmanager-token": "am-token-456", "agent-token": "agent-token-789"}


@pytest.mark.parametrize(("tokens", "message"), [
    ({"operator": "short"}, "the operator-token must be at least 8 characters"),
    ({"agent": "with:colon-token"}, "the agent-token must be at least 8 characters without ':'"),
    ({"alertmanager": "a,b,c,d,e,f"}, "the alertmanager-token must"),
    ({"operator": "same-token-1", "agent": "same-token-1"}, "three different tokens"),
])
def test_tokens_the_controller_would_refuse_fail_the_render(tokens, message):
    with pytest.raises(helm_python.HelmError, match=re.escape(message)):
        render({"tokens": tokens})


def test_existing_secret_is_used_everywhere_and_none_is_created():
    objects = render({"tokens": {"existingSecret": "my-tokens"}})
    assert not by_kind(objects, "Secret")
    container = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    refs = {v["valueFrom"]["secretKeyRef"]["name"] for v in container["env"] if "valueFrom" in v}
    assert refs == {"my-tokens"}
    hook = one(objects, "AlertmanagerConfig")["spec"]["receivers"][0]["webhookConfigs"][0]
    assert hook["httpConfig"]["authorization"]["credentials"]["name"] == "my-tokens"


def test_probes_use_the_controllers_health_routes_and_the_pod_runs_as_the_images_user(default_objects):
    spec = one(default_objects, "Deployment")["spec"]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    routes = {r.path for r in system_router.routes if "GET" in r.methods}
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz" in routes
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz" in routes
    assert {p["name"] for p in container["ports"]} == {container["livenessProbe"]["httpGet"]["port"]}
    uid = int(re.search(r"useradd [^\n]*--uid (\d+)", (ROOT / "Dockerfile").read_text())[1])
    assert pod["securityContext"]["runAsUser"] == uid and pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    # Writable: the database volume (the --db file's folder) and /tmp, nothing else.
    db = Path(container["command"][container["command"].index("--db") + 1])
    assert {m["mountPath"] for m in container["volumeMounts"]} == {str(db.parent), "/tmp"}
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    (data,) = [v for v in pod["volumes"] if v["name"] == "data"]
    assert data["persistentVolumeClaim"]["claimName"] == one(default_objects, "PersistentVolumeClaim")["metadata"]["name"]


#: Runs inside new mount, network and PID namespaces (whatever it leaves running dies with it): every
#: filesystem read-only, a tmpfs on /tmp, the loopback interface up; starts the controller with the
#: pod's command and environment and prints what its endpoints answer, as JSON.
_READ_ONLY_POD = r"""
set -e
ip link set lo up
mount --make-rprivate /
for m in $(awk '{print $2}' /proc/self/mounts | grep -vE '^/(proc|sys|dev)(/|$)' | sort -u); do
    mount -o bind,remount,ro "$m" 2>/dev/null || true
done
mount -t tmpfs tmpfs /tmp
"$@" > /tmp/controller.log 2>&1 &
controller=$!
rc=0
"$PYTHON" -c "$CLIENT" || rc=$?
kill "$controller" && wait "$controller" || true
exit "$rc"
"""
_CLIENT = r"""
import json, os, tempfile, time, urllib.request, urllib.error
base = "http://127.0.0.1:8000"
def call(path, token=None, body=None):
    req = urllib.request.Request(base + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **({"Authorization": "Bearer " + token} if token else {})})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None
def writable(folder):
    try:
        fd, path = tempfile.mkstemp(dir=folder)
    except OSError:
        return False
    os.close(fd)
    os.unlink(path)
    return True
deadline = time.monotonic() + 120
while call("/healthz") != 200 and time.monotonic() < deadline:
    time.sleep(0.5)
tok = json.loads(os.environ["TOKENS"])
out = {"healthz": call("/healthz"), "readyz": call("/readyz"),
       "runs as operator": call("/v1/runs", tok["operator-token"]), "runs as agent": call("/v1/runs", tok["agent-token"]),
       "runs as alertmanager": call("/v1/runs", tok["alertmanager-token"]),
       "alertmanager webhook": call("/v1/alertmanager", tok["alertmanager-token"], {"version": "4", "alerts": []}),
       "root writable": writable("/"),
       "database files": sorted(os.listdir(os.environ["DB_DIR"])) if os.path.isdir(os.environ["DB_DIR"]) else []}
print(json.dumps(out))
print(open("/tmp/controller.log").read()[-2000:])
"""


@pytest.mark.integration
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None,
                    reason="needs root, unshare and ip for a mount and network namespace")
@pytest.mark.skipif(Path(sys.prefix).resolve().is_relative_to("/tmp"),
                    reason="the Python environment lies under /tmp, which this test covers with a fresh tmpfs")
def test_controller_runs_with_the_pods_command_env_and_a_read_only_root(default_objects):
    """The rendered pod's command and environment (its tokens from the rendered Secret) on the real
    controller, with every filesystem read-only but /tmp (readOnlyRootFilesystem; the database
    volume is a folder under the /tmp tmpfs here): it starts, is live and ready, and each token has
    the scope the chart means it to have."""
    secret = one(default_objects, "Secret")
    tokens = _secret_values(secret)
    (container,) = one(default_objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    env = _pod_env(container, {secret["metadata"]["name"]: tokens})
    command = list(container["command"])
    db = command.index("--db") + 1
    db_dir = "/tmp" + str(Path(command[db]).parent)
    command[db] = f"{db_dir}/{Path(command[db]).name}"
    command[0] = str(Path(sys.executable).parent / command[0])  # the venv's console script
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    run_env = base_env | env | {"PYTHONDONTWRITEBYTECODE": "1",  # as the image sets it
                                "PYTHON": sys.executable, "CLIENT": _CLIENT, "TOKENS": json.dumps(tokens), "DB_DIR": db_dir}
    done = subprocess.run(["unshare", "--mount", "--net", "--pid", "--fork", "--kill-child", "--mount-proc", "sh", "-c", _READ_ONLY_POD, "sh", *command],
                          env=run_env, capture_output=True, text=True, timeout=240)
    first, _, log = done.stdout.partition("\n")
    assert done.returncode == 0 and first.startswith("{"), done.stdout + done.stderr
    assert json.loads(first) == {
        "healthz": 200, "readyz": 200, "runs as operator": 200, "runs as agent": 403, "runs as alertmanager": 403,
        "alertmanager webhook": 200, "root writable": False,
        "database files": ["trainguard.db", "trainguard.db-shm", "trainguard.db-wal"]}, log


def test_service_and_servicemonitor_select_the_controller_pod(default_objects):
    pod = one(default_objects, "Deployment")["spec"]["template"]
    service = one(default_objects, "Service")
    monitor = one(default_objects, "ServiceMonitor")
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == service["spec"]["ports"][0]["name"] and endpoint["path"] == "/metrics"
    # The job name the generated controller dashboard selects.
    jobs = set(re.findall(r'job=\\"([^"\\$]+)\\"', (GENERATED / "grafana/dashboards/controller.json").read_text()))
    (relabel,) = endpoint["relabelings"]
    assert relabel == {"action": "replace", "targetLabel": "job", "replacement": jobs.pop()} and not jobs


# -- the training pods: the PodMonitor and the worked example -------------------------------------------
@functools.cache
def _example() -> list[dict]:
    return [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d is not None]


def _example_pods() -> dict[str, dict]:
    """Replica type -> the pod template of the example's PyTorchJob."""
    job = one(_example(), "PyTorchJob")
    return {kind: spec["template"] for kind, spec in job["spec"]["pytorchReplicaSpecs"].items()}


def _selects(selector: dict, labels: dict) -> bool:
    """A label selector (matchLabels and matchExpressions) against ``labels``."""
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions", []):
        present, value = expr["key"] in labels, labels.get(expr["key"])
        ok = {"In": present and value in expr.get("values", []), "NotIn": value not in expr.get("values", []),
              "Exists": present, "DoesNotExist": not present}[expr["operator"]]
        if not ok:
            return False
    return True


def test_podmonitor_selects_the_example_jobs_pods_and_every_rank_port():
    job_namespace = one(_example(), "PyTorchJob")["metadata"]["namespace"]
    objects = render({"podMonitor": {"namespaceSelector": {"matchNames": [job_namespace]}}},
                     name="trainguard", namespace="trainguard")
    monitor = one(objects, "PodMonitor")
    assert job_namespace in monitor["spec"]["namespaceSelector"]["matchNames"]
    endpoints = {e["port"]: e for e in monitor["spec"]["podMetricsEndpoints"]}
    assert all(e["honorLabels"] is True and e["path"] == "/metrics" for e in endpoints.values())
    train_py = one(_example(), "ConfigMap")["data"]["train.py"]
    base_port = int(re.search(r'"TRAINGUARD_METRICS_PORT", "(\d+)"', train_py)[1])
    for kind, pod in _example_pods().items():
        assert _selects(monitor["spec"]["selector"], pod["metadata"]["labels"]), kind
        (container,) = pod["spec"]["containers"]
        ports = container["ports"]
        assert ports, kind
        for local_rank, port in enumerate(ports):
            assert port["name"] in endpoints, f"{kind}: port {port['name']} is not scraped"
            assert port["name"] == f"tg-metrics-{local_rank}" and port["containerPort"] == base_port + local_rank
        nproc = int(re.search(r"--nproc_per_node=(\d+)", " ".join(container["command"]))[1])
        assert len(ports) == nproc, f"{kind}: one named port per local rank"


def test_example_points_the_agent_at_the_chart_service_with_a_token_from_a_secret():
    service = one(render(name="trainguard", namespace="trainguard"), "Service")
    url = f"http://{service['metadata']['name']}.trainguard.svc.cluster.local:{service['spec']['ports'][0]['port']}"
    for kind, pod in _example_pods().items():
        env = {v["name"]: v for v in pod["spec"]["containers"][0]["env"]}
        assert env["TRAINGUARD_CONTROLLER"]["value"] == url, kind
        assert env["TRAINGUARD_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "trainguard-agent-token", "key": "token"}
        # The job name comes from the pod's own label, the run from the operator's job-name label.
        assert env["TRAINGUARD_JOB"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['trainguard.io/job']"
        assert "trainguard.io/job" in pod["metadata"]["labels"]
        assert env["TRAINGUARD_RUN"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['training.kubeflow.org/job-name']"


def test_example_validates():
    docs = _example()
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "PyTorchJob"]
    validate(one(docs, "ConfigMap"))
    job = one(docs, "PyTorchJob")
    # No published schema for Kubeflow's PyTorchJob here: its shape by hand, its pods by Kubernetes'.
    assert job["apiVersion"] == "kubeflow.org/v1" and _DNS_LABEL.match(job["metadata"]["name"])
    assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Master", "Worker"}
    for kind, spec in job["spec"]["pytorchReplicaSpecs"].items():
        assert isinstance(spec["replicas"], int) and spec["restartPolicy"] in {"Always", "OnFailure", "Never", "ExitCode"}
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"{job['metadata']['name']}-{kind.lower()}-0", **spec["template"]["metadata"]},
               "spec": spec["template"]["spec"]}
        validate(pod)
        (container,) = pod["spec"]["containers"]
        assert container["name"] == "pytorch"  # the container name the operator looks for
        assert all(len(p["name"]) <= 15 for p in container["ports"])
    nnodes = int(re.search(r"--nnodes=(\d+)", " ".join(job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]))[1])
    assert nnodes == sum(s["replicas"] for s in job["spec"]["pytorchReplicaSpecs"].values())


def _two_free_ports() -> int:
    """A port p such that p and p + 1 are free on loopback just now."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no two consecutive free ports")


def _step_samples(port: int) -> list[dict[str, str]]:
    """The labels of the trainguard_step samples a rank serves on ``port`` (none yet: [])."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return []
    return [s.labels for f in text_string_to_metric_families(text) if f.name == "trainguard_step"
            for s in f.samples if s.value >= 1]


@pytest.mark.distributed
def test_example_script_serves_each_ranks_metrics_on_its_named_port(tmp_path):
    """The example's train.py under torchrun (one node, two gloo ranks, no controller): local rank
    i serves /metrics on the base port + i, the port the pod names tg-metrics-<i>, with the job and
    run it was given and its rank."""
    script = tmp_path / "train.py"
    script.write_text(one(_example(), "ConfigMap")["data"]["train.py"])
    nproc = int(re.search(r"--nproc_per_node=(\d+)", " ".join(
        _example_pods()["Master"]["spec"]["containers"][0]["command"]))[1])
    base = _two_free_ports()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env.update(TRAINGUARD_JOB="llm-tiny", TRAINGUARD_RUN="llm-tiny-0001", TRAINGUARD_METRICS_PORT=str(base),
               TRAIN_STEPS="100000", OMP_NUM_THREADS="1")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
                "--master_addr=127.0.0.1", f"--master_port={_two_free_ports()}", str(script)]
    proc = subprocess.Popen(torchrun, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        seen: dict[int, list[dict[str, str]]] = {}
        deadline = time.monotonic() + 240  # a bound on a stuck start, not a speed check
        while len(seen) < nproc and proc.poll() is None and time.monotonic() < deadline:
            for rank in range(nproc):
                if rank not in seen and (samples := _step_samples(base + rank)):
                    seen[rank] = samples
            time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out = proc.communicate(timeout=60)[0].decode(errors="replace")
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out = proc.communicate()[0].decode(errors="replace")
    assert sorted(seen) == list(range(nproc)), out[-3000:]
    for rank, samples in seen.items():
        assert samples == [{"job": "llm-tiny", "run": "llm-tiny-0001", "rank": str(rank)}]


@pytest.mark.parametrize("values", [{"podMonitor": {"portNamePrefix": "trainguard-metrics"}},
                                    {"podMonitor": {"portNamePrefix": "trainguard-ml", "localRanksPerPod": 11}}])
def test_podmonitor_refuses_port_names_kubernetes_would_refuse(values):
    with pytest.raises(helm_python.HelmError, match=re.escape("port names (<prefix>-<local rank>) must be at most 15")):
        render(values)
    # One rank fewer fits: trainguard-ml-9 is 15 characters, trainguard-ml-10 16.
    if values["podMonitor"].get("localRanksPerPod") == 11:
        ports = [e["port"] for e in one(render({"podMonitor": {**values["podMonitor"], "localRanksPerPod": 10}}),
                                        "PodMonitor")["spec"]["podMetricsEndpoints"]]
        assert ports[-1] == "trainguard-ml-9" and len(ports) == 10


# -- the chart as a package ---------------------------------------------------------------------------
def test_chart_lints_clean_and_its_package_renders_the_same(tmp_path):
    report = helm_python.lint(CHART, strict=True)
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []
    archive = Path(helm_python.package(CHART, destination=tmp_path))
    assert archive.name == "trainguard-0.1.0.tgz"
    packaged = helm_python.Chart.load_archive(archive.read_bytes())
    values = {"tokens": {"operator": "op-token-123", "alertmanager": "am-token-456", "agent": "agent-token-789"}}
    assert render_templates(values, chart=packaged) == render_templates(values)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (scripts/setup.sh)")
def test_promtool_accepts_the_rendered_prometheusrule(default_objects, tmp_path):
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump(one(default_objects, "PrometheusRule")["spec"]))
    done = subprocess.run(["promtool", "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_agent_labels_are_the_ones_the_dashboards_group_by():
    """honorLabels keeps the agent's own job, run and rank: the labels every dashboard variable uses."""
    dashboard = json.loads((GENERATED / "grafana/dashboards/training-stability.json").read_text())
    variables = [v["name"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    assert variables == list(BASE_LABELS)


# -- the documentation states the chart's defaults --------------------------------------------------
def _doc_value(value: object) -> str:
    """How docs/kubernetes.md writes a default."""
    if value == "" or value == [] or value == {}:
        return json.dumps(value)
    if isinstance(value, dict) and len(value) == 1:
        ((k, v),) = value.items()
        return f"{k}: {json.dumps(v)}"
    return str(value)


def _split_outside_backticks(text: str) -> list[str]:
    """``text`` split at each ", " that is not inside a `code span`."""
    parts, start, inside = [], 0, False
    for i, ch in enumerate(text):
        if ch == "`":
            inside = not inside
        elif not inside and text.startswith(", ", i):
            parts.append(text[start:i])
            start = i + 2
    return [*parts, text[start:]]


def test_kubernetes_doc_states_the_charts_defaults():
    doc = (ROOT / "docs/kubernetes.md").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    table = doc[doc.index("\n## Values\n"):doc.index("\n## How the chart is kept right\n")]
    checked = []
    for row in re.findall(r"^\| (.+?) \| (.+?) \|", table, flags=re.M)[2:]:
        keys = re.findall(r"`([A-Za-z][\w.]*)`", row[0])
        parts = _split_outside_backticks(row[1])
        if len(keys) != len(parts) or row[0].count("`") != 2 * len(keys):
            continue
        for key, part in zip(keys, parts):
            value = functools.reduce(lambda d, k: d[k], key.split("."), values)
            if re.fullmatch(r"`[^`]*`", part):
                assert part.strip("`") == _doc_value(value), f"docs say {key} = {part}, values.yaml {value!r}"
            elif re.fullmatch(r"\d+", part):
                assert int(part) == value, f"docs say {key} = {part}, values.yaml {value!r}"
            else:
                continue
            checked.append(key)
    assert len(checked) >= 12, checked
    # The pod label and port names of "Label the training pods", and the Secret's keys.
    (label,) = values["podMonitor"]["podLabels"].items()
    assert f'`{label[0]}: "{label[1]}"`' in doc and f"`{values['podMonitor']['portNamePrefix']}-<local rank>`" in doc
    keys = set(re.findall(r"^\| `([a-z]+-token)` \|", doc, flags=re.M))
    assert keys == set(one(render(), "Secret")["data"])


def test_a_postgresql_secret_replaces_the_sqlite_volume():
    """``database.existingSecret``: the controller reads its PostgreSQL URL from that Secret's key
    (TRAINGUARD_DB), gets no ``--db`` file, and no claim is made or mounted."""
    objects = render({"database": {"existingSecret": "tg-postgres", "key": "dsn"}})
    (deployment,) = by_kind(objects, "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert "--db" not in container["command"]
    env = {e["name"]: e for e in container["env"]}
    assert env["TRAINGUARD_DB"]["valueFrom"] == {"secretKeyRef": {"name": "tg-postgres", "key": "dsn"}}
    assert by_kind(objects, "PersistentVolumeClaim") == []
    data = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "data")
    assert data == {"name": "data", "emptyDir": {}}
    # the default stays SQLite on its claim
    (default,) = by_kind(render(), "Deployment")
    command = default["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--db") + 1] == "/data/trainguard.db" and len(by_kind(render(), "PersistentVolumeClaim")) == 1
