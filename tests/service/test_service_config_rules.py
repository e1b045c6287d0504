"""``trainguard serve --rules FILE`` (``Settings.rules``): the file is loaded at start-up and wins
over rules stored through ``PUT /v1/rules``; without it the last stored rules apply. And
``trainguard rules check FILE`` validates a file offline. Real ``trainguard serve`` processes on
one database, restarted between the phases."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from trainguard.service.rules import default_rules_text

pytestmark = pytest.mark.integration

ENV = {"TRAINGUARD_OPERATOR_TOKENS": "", "TRAINGUARD_AGENT_TOKENS": ""}  # no tokens: loopback, open
FILE_RULES = "rules:\n  - {name: from_file, kind: threshold, metric: trainguard_gpu_temperature_celsius, op: '>', value: 10, actions: [notify]}\n"
API_RULES = "rules:\n  - {name: from_api, kind: threshold, metric: trainguard_gpu_temperature_celsius, op: '>', value: 100, actions: [notify]}\n"


def _fired(url: str, run: str, value: float) -> list[str]:
    """Register ``run`` and post one report with ``trainguard_gpu_temperature_celsius = value``; the rules that fired."""
    assert httpx.post(f"{url}/v1/runs", json={"job": "job-r", "run": run, "world_size": 1}, timeout=10).status_code == 200
    report = {"job": "job-r", "step_first": 1, "step_last": 1, "time": 1.0, "values": {"trainguard_gpu_temperature_celsius": value}}
    answer = httpx.post(f"{url}/v1/runs/{run}/reports", json=report, timeout=10)
    assert answer.status_code == 200, answer.text
    return answer.json()["alerts"]


def _rules(url: str) -> dict:
    return httpx.get(f"{url}/v1/rules", timeout=10).json()


def test_rules_file_at_start_up_wins_over_rules_stored_through_the_api(tmp_path: Path, serve) -> None:
    db, rules_file = tmp_path / "tg.db", tmp_path / "rules.yaml"
    rules_file.write_text(FILE_RULES)
    srv = serve(db, ENV, ["--rules", str(rules_file)])
    assert (_rules(srv.url)["source"], _rules(srv.url)["text"]) == (f"file:{rules_file}", FILE_RULES)
    assert _fired(srv.url, "run-1", 11.0) == ["from_file"]  # the file's rules, not the defaults

    put = httpx.put(f"{srv.url}/v1/rules", content=API_RULES, timeout=10, headers={"content-type": "application/yaml"})
    assert put.status_code == 200 and put.json()["source"] == "api"
    assert _fired(srv.url, "run-2", 11.0) == [] and _fired(srv.url, "run-3", 101.0) == ["from_api"]
    srv.stop()

    srv = serve(db, ENV, ["--rules", str(rules_file)])  # the file again: it wins over the stored API rules
    assert (_rules(srv.url)["source"], _rules(srv.url)["text"]) == (f"file:{rules_file}", FILE_RULES)
    assert _fired(srv.url, "run-4", 11.0) == ["from_file"]
    srv.stop()

    srv = serve(db, ENV)  # no file: the last stored rules (the file's, stored at the last start)
    assert _rules(srv.url)["text"] == FILE_RULES
    assert _fired(srv.url, "run-5", 11.0) == ["from_file"]
    srv.stop()

    rules_file.write_text("rules:\n  - {name: broken, kind: threshold, metric: trainguard_gpu_temperature_celsius, op: '>>', value: 1}\n")
    bad = subprocess.run([sys.executable, "-m", "trainguard.cli", "serve", "--port", "0", "--db", str(db),
                          "--rules", str(rules_file)], capture_output=True, text=True, timeout=60, env=srv.env)
    assert bad.returncode != 0 and "invalid rules: rules.0" in bad.stderr and "op" in bad.stderr and "Traceback" not in bad.stderr


def _check(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainguard.cli", "rules", "check", str(path)],
                          capture_output=True, text=True, timeout=60)


def test_rules_check_validates_a_file_offline(tmp_path: Path) -> None:
    defaults = tmp_path / "defaults.yaml"
    defaults.write_text(default_rules_text())
    ok = _check(defaults)
    raw = yaml.safe_load(default_rules_text())["rules"]
    off = sum(r.get("enabled") is False for r in raw)
    assert off == 2  # the adaptive batch size's rules ship turned off
    assert ok.returncode == 0 and ok.stdout.strip() == (
        f"{defaults}: {len(raw) - off} rules ({off} more turned off), overrides for 0 job(s): OK"), ok.stderr

    bad = tmp_path / "bad.yaml"
    bad.write_text("rules:\n  - {name: x, kind: threshold, metric: trainguard_gpu_temperature_celsius, op: '>', value: NaN-ish}\n")
    out = _check(bad)
    assert out.returncode == 1 and out.stdout == "" and str(bad) in out.stderr and "Traceback" not in out.stderr
    missing = _check(tmp_path / "nope.yaml")
    assert missing.returncode == 1 and "nope.yaml" in missing.stderr and "Traceback" not in missing.stderr


@pytest.mark.parametrize("text", ["", "# the rules\n", "version: 1\nrecovery: {}\n"])
def test_a_rules_file_without_a_rules_list_stops_the_start_up_instead_of_removing_every_rule(
        tmp_path: Path, text: str) -> None:
    """An empty ``--rules`` file (a config map mounted before it was written, an editor's truncation)
    would remove every rule, the safety rules included: the controller refuses to start, and
    ``rules check`` says why. The file's own ``rules: []`` removes them, as the operator wrote it."""
    db, rules_file = tmp_path / "tg.db", tmp_path / "rules.yaml"
    rules_file.write_text(text)
    env = dict(os.environ) | ENV
    bad = subprocess.run([sys.executable, "-m", "trainguard.cli", "serve", "--port", "0", "--db", str(db),
                          "--rules", str(rules_file)], capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr, bad.stderr
    assert "has no 'rules' list: it would remove every rule" in bad.stderr and "write 'rules: []' in the file" in bad.stderr
    checked = _check(rules_file)
    assert checked.returncode == 1 and "has no 'rules' list" in checked.stderr

    rules_file.write_text("rules: []\n")
    assert _check(rules_file).returncode == 0


def test_a_rules_file_saying_no_rules_starts_without_any(tmp_path: Path, serve) -> None:
    db, rules_file = tmp_path / "tg.db", tmp_path / "rules.yaml"
    rules_file.write_text("rules: []\n")
    srv = serve(db, ENV, ["--rules", str(rules_file)])
    assert _rules(srv.url)["text"] == "rules: []\n"
    assert _fired(srv.url, "run-1", 1e9) == []
    srv.stop()
