"""docker-compose.postgres.yml, the compose stack's optional PostgreSQL mode: valid against the
compose specification, the controller's command as in docker-compose.yml but for a PostgreSQL URL
on the stack's own `postgres` service (healthy first, no port published), and an image that has
the driver."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

from trainguard.service.config import Settings

ROOT = Path(__file__).resolve().parents[2]
OVERRIDE = ROOT / "docker-compose.postgres.yml"


def _defaults(text: str) -> str:
    """Compose's ``${VAR:-default}`` with nothing set."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", text)


def test_override_matches_the_compose_spec() -> None:
    checker = Path(sys.executable).parent / "check-jsonschema"
    done = subprocess.run([str(checker), "--builtin-schema", "vendor.compose-spec", str(OVERRIDE)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_controller_stores_in_the_stacks_postgres_service() -> None:
    base = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    override = yaml.safe_load(_defaults(OVERRIDE.read_text()))["services"]
    command, base_command = override["controller"]["command"], base["controller"]["command"]
    db = command[command.index("--db") + 1]
    # the same command as the SQLite stack's but for the database
    assert command[:command.index("--db")] == base_command[:base_command.index("--db")]
    assert re.fullmatch(r"postgresql://trainguard:[^@]+@postgres:5432/trainguard", db)
    assert Settings(db=db).db == db  # the controller takes it as a URL, not a file name
    assert override["controller"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    pg = override["postgres"]
    assert pg["environment"]["POSTGRES_USER"] == "trainguard" and pg["environment"]["POSTGRES_DB"] == "trainguard"
    assert pg["environment"]["POSTGRES_PASSWORD"] == db.split(":")[2].split("@")[0]
    assert pg["healthcheck"]["test"][:2] == ["CMD", "pg_isready"] and "ports" not in pg
    assert ":" in pg["image"] and not pg["image"].endswith(":latest")


def test_the_controller_image_installs_the_postgres_extra() -> None:
    controller_stage = (ROOT / "Dockerfile").read_text().split("FROM controller AS trainer")[0]
    installs = [line for line in controller_stage.splitlines() if "pip install" in line]
    assert any(re.search(r"\.\[[a-z,]*\bpostgres\b[a-z,]*\]", line) for line in installs), installs
