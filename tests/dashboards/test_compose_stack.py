"""docker-compose.yml: valid against the compose specification (and by `docker compose config`
where the compose plugin is installed), every file it builds or mounts exists, images are pinned
to the versions the generated files target, nothing must be set before `docker compose up`: the
`tokens` service (scripts/compose_tokens.sh) generates each client's token into that client's own
volume, with only the scopes it needs, and keeps it across restarts."""

from __future__ import annotations

import os
import re
import shutil
import stat
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
COMPOSE_TOKENS = ROOT / "scripts" / "compose_tokens.sh"


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
    assert {"pyproject.toml", "README.md", "trainer_agent", "service", "dashboards", "scripts/compose_tokens.sh"} <= set(copied)
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
    assert services["tokens"]["build"]["target"] == "controller"
    assert services["webhook-sink"]["build"]["target"] == "controller"
    assert services["trainer"]["build"]["target"] == "trainer"


def test_services_health_checks_volumes_and_ports(compose):
    services = compose["services"]
    assert set(services) == {"tokens", "controller", "trainer", "prometheus", "alertmanager", "webhook-sink", "grafana"}
    for name, service in services.items():
        if name == "tokens":  # runs once and exits
            assert service["healthcheck"] == {"disable": True} and service["restart"] == "no"
            continue
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
    command = trainer["command"][trainer["command"].index("--") + 1:]  # after the token set-up
    assert command[:3] == ["python", "-m", "trainguard.demo"]  # what `trainguard demo` runs
    assert command[command.index("--controller") + 1] == "http://controller:8000"
    assert command[command.index("--metrics-host") + 1] == "0.0.0.0"  # advertised as its hostname
    assert trainer["hostname"] == "trainer"
    port = command[command.index("--metrics-port") + 1]
    assert f"http://127.0.0.1:{port}/metrics" in " ".join(trainer["healthcheck"]["test"])


#: What .env may set (all optional), each handed to the `tokens` service.
OPTIONAL = ("TRAINGUARD_OPERATOR_TOKEN", "TRAINGUARD_PROMETHEUS_TOKEN", "TRAINGUARD_ALERTMANAGER_TOKEN",
            "TRAINGUARD_DEMO_OPERATOR_TOKEN", "TRAINGUARD_AGENT_TOKEN", "TRAINGUARD_WEBHOOK_SECRET",
            "GRAFANA_ADMIN_PASSWORD")
#: service -> (its token volume, where it mounts it)
TOKEN_MOUNTS = {"controller": ("controller-tokens", "/tokens"), "trainer": ("trainer-tokens", "/tokens"),
                "prometheus": ("prometheus-token", "/run/secrets"), "alertmanager": ("alertmanager-token", "/run/secrets"),
                "webhook-sink": ("webhook-sink-secret", "/tokens"), "grafana": ("grafana-secret", "/run/secrets")}
#: token volume -> its folder in the `tokens` service
TOKEN_FOLDERS = {"controller-tokens": "controller", "trainer-tokens": "trainer", "prometheus-token": "prometheus",
                 "alertmanager-token": "alertmanager", "webhook-sink-secret": "webhook-sink", "grafana-secret": "grafana"}


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in OPTIONAL and not k.startswith("TRAINGUARD_")}


def _tokens(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", str(COMPOSE_TOKENS), *args], capture_output=True, text=True, timeout=60,
                          env={**_clean_env(), **(env or {})})


def test_docker_compose_config_accepts_the_file_with_nothing_set():
    """Where the compose plugin is installed (`docker compose config` needs no engine), the file
    renders with no .env and no variable set; elsewhere the schema test above and the next one
    stand in for it."""
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30).returncode != 0:
        pytest.skip("no `docker compose` plugin on this machine")
    done = subprocess.run([docker, "compose", "-f", str(COMPOSE), "--project-directory", str(ROOT), "config", "-q"],
                          capture_output=True, text=True, timeout=60, env=_clean_env())
    assert done.returncode == 0, done.stdout + done.stderr


def test_no_variable_must_be_set(compose):
    text = COMPOSE.read_text()
    uses = re.findall(r"\$\{([A-Za-z0-9_]+)([^}]*)\}", text)
    assert uses
    for name, rest in uses:
        assert rest == ":-", f"${{{name}{rest}}}: every variable is optional with an empty default"
    assert "$" not in re.sub(r"\$\{[A-Za-z0-9_]+:-\}", "", text), "a bare $VAR is substituted too"
    tokens_env = compose["services"]["tokens"]["environment"]
    assert tokens_env == {name: f"${{{name}:-}}" for name in OPTIONAL}
    example = dict(line.split("=", 1) for line in (ROOT / ".env.example").read_text().splitlines()
                   if line and not line.startswith("#"))
    assert set(OPTIONAL) <= example.keys() and all(example[k] == "" for k in OPTIONAL)
    assert "secrets" not in compose  # the tokens live in volumes, not in compose's environment secrets


def test_each_service_mounts_only_its_own_tokens(compose):
    services = compose["services"]
    tokens = services["tokens"]
    assert tokens["user"] == "0:0" and tokens["command"] == ["trainguard-compose-tokens", "init", "/tokens"]
    assert sorted(tokens["volumes"]) == sorted(f"{v}:/tokens/{f}" for v, f in TOKEN_FOLDERS.items())
    for name, service in services.items():
        if name == "tokens":
            continue
        theirs = [v for v in service.get("volumes", []) if v.split(":")[0] in TOKEN_FOLDERS]
        assert theirs == [f"{TOKEN_MOUNTS[name][0]}:{TOKEN_MOUNTS[name][1]}:ro"], name
        assert services[name]["depends_on"].get("tokens", {"condition": "service_completed_successfully"}) == \
            {"condition": "service_completed_successfully"}
        assert TOKEN_MOUNTS[name][0] in compose["volumes"]
    # every service that reads a token starts after the `tokens` service, directly or through one that does
    for name in ("controller", "webhook-sink", "grafana"):
        assert services[name]["depends_on"]["tokens"] == {"condition": "service_completed_successfully"}
    assert services["alertmanager"]["depends_on"]["tokens"] == {"condition": "service_completed_successfully"}
    assert PROMETHEUS_TOKEN_SECRET == "/run/secrets/trainguard_prometheus_token"
    assert ALERTMANAGER_TOKEN_SECRET == "/run/secrets/trainguard_alertmanager_token"
    grafana = services["grafana"]["environment"]
    assert grafana["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/run/secrets/grafana_admin_password"
    assert services["controller"]["command"][:4] == ["trainguard-compose-tokens", "controller", "/tokens", "--"]
    assert services["trainer"]["command"][:5] == ["trainguard-compose-tokens", "env", "/tokens",
                                                  "TRAINGUARD_TOKEN=agent", "TRAINGUARD_OPERATOR_TOKEN=demo_operator"]
    assert services["webhook-sink"]["command"][:4] == ["trainguard-compose-tokens", "env", "/tokens",
                                                       "TRAINGUARD_WEBHOOK_SECRET=webhook_secret"]


@pytest.fixture()
def token_root(tmp_path) -> Path:
    done = _tokens("init", str(tmp_path))
    assert done.returncode == 0, done.stderr
    return tmp_path


def _read(root: Path, folder: str, name: str) -> str:
    return (root / folder / name).read_text()


def test_init_generates_a_token_per_client_with_only_its_scopes(token_root):
    """The token tables the controller reads, parsed as the controller parses them, give each
    client's token (from that client's own folder) exactly the scopes it needs."""
    from trainguard.service.auth import TokenTable

    table = TokenTable(tuple(_read(token_root, "controller", "operator_tokens").split(",")),
                       tuple(_read(token_root, "controller", "agent_tokens").split(",")))
    clients = {"operator": ("controller", "operator"), "prometheus": ("prometheus", "trainguard_prometheus_token"),
               "alertmanager": ("alertmanager", "trainguard_alertmanager_token"),
               "demo": ("trainer", "demo_operator"), "agent": ("trainer", "agent")}
    values = {client: _read(token_root, *where) for client, where in clients.items()}
    scopes = {client: table.authenticate(f"Bearer {value}").scopes for client, value in values.items()}
    assert scopes == {"operator": {"read", "command", "rules", "webhooks", "tokens"}, "prometheus": {"read"},
                      "alertmanager": {"command"}, "demo": {"read", "command"}, "agent": {"agent"}}
    secrets = [_read(token_root, "webhook-sink", "webhook_secret"), _read(token_root, "grafana", "grafana_admin_password")]
    assert all(re.fullmatch(r"[0-9a-f]{64}", v) for v in [*values.values(), *secrets])  # 256 random bits each
    assert len({*values.values(), *secrets}) == 7
    # each file readable by its service's user only (root here: the owners are set)
    owners = {"controller": 10001, "trainer": 10001, "webhook-sink": 10001, "prometheus": 65534,
              "alertmanager": 65534, "grafana": 472}
    for folder, uid in owners.items():
        for path in (token_root / folder).iterdir():
            st = path.stat()
            assert stat.S_IMODE(st.st_mode) == 0o400, path
            if os.geteuid() == 0:
                assert st.st_uid == uid, path


def test_tokens_survive_a_restart_and_env_values_win(token_root):
    before = {p: p.read_text() for p in token_root.rglob("*") if p.is_file()}
    again = _tokens("init", str(token_root))
    assert again.returncode == 0, again.stderr
    assert {p: p.read_text() for p in token_root.rglob("*") if p.is_file()} == before
    fixed = _tokens("init", str(token_root), env={"TRAINGUARD_OPERATOR_TOKEN": "fixed-operator-token",
                                                 "GRAFANA_ADMIN_PASSWORD": "s3cret! with spaces"})
    assert fixed.returncode == 0, fixed.stderr
    assert _read(token_root, "controller", "operator") == "fixed-operator-token"
    assert _read(token_root, "controller", "operator_tokens").split(",")[0] == "fixed-operator-token"
    assert _read(token_root, "grafana", "grafana_admin_password") == "s3cret! with spaces"
    assert _read(token_root, "trainer", "agent") == before[token_root / "trainer" / "agent"]


@pytest.mark.parametrize("value, message", [("short", "agent: a token must have at least 8 characters"),
                                            ("has:colon-in-it", "agent: a token may hold only letters, digits"),
                                            ("has,comma-in-it", "agent: a token may hold only letters, digits")])
def test_init_refuses_a_token_the_controller_would_refuse(tmp_path, value, message):
    done = _tokens("init", str(tmp_path), env={"TRAINGUARD_AGENT_TOKEN": value})
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not (tmp_path / "controller" / "agent_tokens").exists()


def test_the_controller_and_clients_start_with_their_own_tokens(token_root):
    show = [sys.executable, "-c", "import os, sys; print(os.environ.get(sys.argv[1], '-'), os.environ.get(sys.argv[2], '-'))"]
    done = _tokens("controller", str(token_root / "controller"), "--", *show,
                   "TRAINGUARD_OPERATOR_TOKENS", "TRAINGUARD_AGENT_TOKENS")
    assert done.returncode == 0, done.stderr
    operator = _read(token_root, "controller", "operator")
    banner, command, served = done.stdout.splitlines()
    assert banner == f"trainguard operator token (every scope): {operator}"
    assert command == f"  read it again with: docker compose exec controller cat {token_root / 'controller'}/operator"
    assert served.split() == [_read(token_root, "controller", "operator_tokens"), _read(token_root, "controller", "agent_tokens")]
    done = _tokens("env", str(token_root / "trainer"), "TRAINGUARD_TOKEN=agent", "TRAINGUARD_OPERATOR_TOKEN=demo_operator",
                   "--", *show, "TRAINGUARD_TOKEN", "TRAINGUARD_OPERATOR_TOKEN")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [_read(token_root, "trainer", "agent"), _read(token_root, "trainer", "demo_operator")]
    missing = _tokens("env", str(token_root / "trainer"), "TRAINGUARD_TOKEN=nothing-here", "--", "true")
    assert missing.returncode == 2 and "nothing-here is missing or empty" in missing.stderr
