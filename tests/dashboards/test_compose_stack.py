"""docker-compose.yml: valid against the compose specification, every file it builds or mounts
exists, images are pinned to the versions the generated files target, no secret has a default."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainguard.dashboards import build
from trainguard.dashboards.common import GRAFANA_IMAGE
from trainguard.dashboards.stack import ALERTMANAGER_IMAGE, ALERTMANAGER_TOKEN_SECRET, PROMETHEUS_IMAGE, PROMETHEUS_TOKEN_SECRET

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
CHECK_JSONSCHEMA = Path(sys.executable).parent / "check-jsonschema"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_file_matches_the_compose_spec():
    done = subprocess.run([str(CHECK_JSONSCHEMA), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_schema_check_rejects_a_broken_compose_file(tmp_path):
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE.read_text().replace("    healthcheck:\n", "    healthcheck: yes-please\n", 1))
    done = subprocess.run([str(CHECK_JSONSCHEMA), "--builtin-schema", "vendor.compose-spec", str(broken)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0


def test_every_built_and_mounted_file_exists(compose):
    checked = 0
    for name, service in compose["services"].items():
        if "build" in service:
            context = ROOT / service["build"]["context"]
            assert (context / service["build"]["dockerfile"]).is_file(), name
            checked += 1
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith((".", "/")):
                assert (ROOT / source).is_dir() and any((ROOT / source).iterdir()), f"{name}: {source}"
                checked += 1
            else:
                assert source in compose["volumes"], f"{name}: undeclared named volume {source}"
    assert checked >= 8
    # Files the images read from the mounts: the prometheus rules, the alertmanager config, the
    # provisioning files and the home dashboard.
    grafana = compose["services"]["grafana"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{build.GRAFANA_DASHBOARDS_PATH}/training-stability.json"
    mounts = dict(v.split(":")[1::-1] for v in grafana["volumes"] if v.startswith("./"))
    host_dir = ROOT / mounts[build.GRAFANA_DASHBOARDS_PATH]
    assert (host_dir / "training-stability.json").is_file()
    prom_dir = [v for v in compose["services"]["prometheus"]["volumes"] if v.startswith("./")][0].split(":")[0]
    prom_cfg = yaml.safe_load((ROOT / prom_dir / "prometheus.yml").read_text())
    for rule_file in prom_cfg["rule_files"]:
        assert (ROOT / prom_dir / rule_file).is_file()
    copied = [word for line in (ROOT / "Dockerfile").read_text().splitlines() if line.startswith("COPY ")
              for word in line.split()[1:-1]]
    assert {"pyproject.toml", "README.md", "trainer_agent", "service", "dashboards"} <= set(copied)
    for path in copied:
        assert (ROOT / path).exists(), path


def test_images_are_pinned_to_what_the_generated_files_target(compose):
    images = {name: s["image"] for name, s in compose["services"].items()}
    assert images["prometheus"] == PROMETHEUS_IMAGE and re.fullmatch(r"prom/prometheus:v3\.\d+\.\d+", PROMETHEUS_IMAGE)
    assert images["alertmanager"] == ALERTMANAGER_IMAGE
    assert images["grafana"] == GRAFANA_IMAGE
    for name, image in images.items():
        assert not image.endswith(":latest") and ":" in image, name
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11\.\d+-slim-bookworm AS controller$", dockerfile, re.M)


def test_controller_image_has_no_torch(compose):
    """The controller never imports torch, so its image does not install it; only the trainer's does."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    controller_stage, trainer_stage = dockerfile.split("FROM controller AS trainer")
    installs = [line for line in controller_stage.splitlines() if "pip install" in line]
    assert installs and all("agent" not in line and "torch==" not in line for line in installs)
    assert "grep -v '^torch=='" in controller_stage
    assert "pip install" in trainer_stage and "torch_pin" in trainer_stage
    services = compose["services"]
    assert services["controller"]["build"]["target"] == "controller"
    assert services["webhook-sink"]["build"]["target"] == "controller"
    assert services["trainer"]["build"]["target"] == "trainer"


def test_services_health_checks_volumes_and_ports(compose):
    services = compose["services"]
    assert set(services) == {"controller", "trainer", "prometheus", "alertmanager", "webhook-sink", "grafana"}
    for name, service in services.items():
        assert service["healthcheck"]["test"][0] == "CMD", name
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
    assert "controller-data:/data" in services["controller"]["volumes"]
    assert "/data/trainguard.db" in services["controller"]["command"]
    assert "prometheus-data:/prometheus" in services["prometheus"]["volumes"]
    assert services["prometheus"]["depends_on"]["controller"]["condition"] == "service_healthy"
    assert services["trainer"]["depends_on"]["controller"]["condition"] == "service_healthy"
    assert services["controller"]["build"]["dockerfile"] == "Dockerfile"
    trainer = services["trainer"]
    command = trainer["command"]
    assert command[:3] == ["python", "-m", "trainguard.demo"]  # what `trainguard demo` runs
    assert command[command.index("--controller") + 1] == "http://controller:8000"
    assert command[command.index("--metrics-host") + 1] == "0.0.0.0"  # advertised as its hostname
    assert trainer["hostname"] == "trainer"
    port = command[command.index("--metrics-port") + 1]
    assert f"http://127.0.0.1:{port}/metrics" in " ".join(trainer["healthcheck"]["test"])


TOKENS = ("TRAINGUARD_OPERATOR_TOKEN", "TRAINGUARD_PROMETHEUS_TOKEN", "TRAINGUARD_ALERTMANAGER_TOKEN",
          "TRAINGUARD_DEMO_OPERATOR_TOKEN", "TRAINGUARD_AGENT_TOKEN")


def test_no_secret_has_a_default(compose):
    text = COMPOSE.read_text()
    for variable in (*TOKENS, "GRAFANA_ADMIN_PASSWORD", "TRAINGUARD_WEBHOOK_SECRET"):
        uses = re.findall(r"\$\{" + variable + r"([^}]*)\}", text)
        assert uses and all(u.startswith(":?") for u in uses), variable
    env = compose["services"]["controller"]["environment"]
    assert env["TRAINGUARD_AGENT_TOKENS"].startswith("${TRAINGUARD_AGENT_TOKEN:?")
    example = dict(line.split("=", 1) for line in (ROOT / ".env.example").read_text().splitlines()
                   if line and not line.startswith("#"))
    assert {*TOKENS, "GRAFANA_ADMIN_PASSWORD"} <= example.keys()
    assert all(example[t] == "" for t in TOKENS)
    assert example["GRAFANA_ADMIN_PASSWORD"] == example["TRAINGUARD_WEBHOOK_SECRET"] == ""


def test_each_client_holds_only_the_scopes_it_needs(compose):
    """Prometheus reads, Alertmanager commands, the demo trainer's operator side reads and
    commands: the controller's token table, parsed as the controller parses it, says so."""
    from trainguard.service.auth import TokenTable

    values = {"TRAINGUARD_OPERATOR_TOKEN": "op-token-000", "TRAINGUARD_PROMETHEUS_TOKEN": "prom-token-00",
              "TRAINGUARD_ALERTMANAGER_TOKEN": "am-token-0000", "TRAINGUARD_DEMO_OPERATOR_TOKEN": "demo-token-00",
              "TRAINGUARD_AGENT_TOKEN": "agent-token-0"}
    env = compose["services"]["controller"]["environment"]
    expand = lambda text: re.sub(r"\$\{(\w+):\?[^}]*\}", lambda m: values[m.group(1)], text)  # noqa: E731
    table = TokenTable(tuple(expand(env["TRAINGUARD_OPERATOR_TOKENS"]).split(",")), tuple(expand(env["TRAINGUARD_AGENT_TOKENS"]).split(",")))
    scopes = {k: table.authenticate(f"Bearer {v}").scopes for k, v in values.items()}
    assert scopes["TRAINGUARD_PROMETHEUS_TOKEN"] == {"read"}
    assert scopes["TRAINGUARD_ALERTMANAGER_TOKEN"] == {"command"}
    assert scopes["TRAINGUARD_DEMO_OPERATOR_TOKEN"] == {"read", "command"}
    assert scopes["TRAINGUARD_AGENT_TOKEN"] == {"agent"}
    trainer = compose["services"]["trainer"]["environment"]
    assert trainer["TRAINGUARD_TOKEN"].startswith("${TRAINGUARD_AGENT_TOKEN:?")
    assert trainer["TRAINGUARD_OPERATOR_TOKEN"].startswith("${TRAINGUARD_DEMO_OPERATOR_TOKEN:?")
    assert compose["secrets"]["trainguard_prometheus_token"] == {"environment": "TRAINGUARD_PROMETHEUS_TOKEN"}
    assert compose["secrets"]["trainguard_alertmanager_token"] == {"environment": "TRAINGUARD_ALERTMANAGER_TOKEN"}
    assert compose["services"]["prometheus"]["secrets"] == ["trainguard_prometheus_token"]
    assert compose["services"]["alertmanager"]["secrets"] == ["trainguard_alertmanager_token"]
    assert PROMETHEUS_TOKEN_SECRET == "/run/secrets/trainguard_prometheus_token"
    assert ALERTMANAGER_TOKEN_SECRET == "/run/secrets/trainguard_alertmanager_token"
