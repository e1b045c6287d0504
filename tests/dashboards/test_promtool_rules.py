"""promtool and amtool on the generated Prometheus and Alertmanager files, the hand-written rule
unit tests, and every dashboard query parsed by Prometheus 2.42's own parser."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from trainguard.dashboards import build
from trainguard.dashboards.stack import ALERTMANAGER_TOKEN_SECRET, PROMETHEUS_TOKEN_SECRET

PROMTOOL = shutil.which("promtool")
AMTOOL = shutil.which("amtool")
GENERATED = build.GENERATED
RULES_TEST = Path(build.__file__).resolve().parent / "promtool" / "rules_test.yml"

pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (scripts/setup.sh)")


def _run(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done


def test_check_config_of_the_checked_in_prometheus_yml():
    _run(PROMTOOL, "check", "config", "--syntax-only", str(GENERATED / "prometheus/prometheus.yml"))


def test_check_config_with_the_token_file_and_rules_present(tmp_path):
    """The full check (token file and rule files must exist) on a copy whose token path points at
    a temporary file: what Prometheus sees in the compose stack."""
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    text = (GENERATED / "prometheus/prometheus.yml").read_text().replace(PROMETHEUS_TOKEN_SECRET, str(token))
    (tmp_path / "prometheus.yml").write_text(text)
    shutil.copy(GENERATED / "prometheus/rules.yml", tmp_path / "rules.yml")
    out = _run(PROMTOOL, "check", "config", str(tmp_path / "prometheus.yml")).stdout
    assert "SUCCESS: 1 rule files found" in out


def test_check_config_fails_on_a_broken_config(tmp_path):
    (tmp_path / "prometheus.yml").write_text("scrape_configs:\n  - job_name: x\n    honor_labels: maybe\n")
    done = subprocess.run([PROMTOOL, "check", "config", "--syntax-only", str(tmp_path / "prometheus.yml")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0


def test_check_rules():
    out = _run(PROMTOOL, "check", "rules", str(GENERATED / "prometheus/rules.yml")).stdout
    rules = yaml.safe_load((GENERATED / "prometheus/rules.yml").read_text())
    count = sum(len(g["rules"]) for g in rules["groups"])
    assert f"SUCCESS: {count} rules found" in out


def test_rule_unit_tests_pass():
    out = _run(PROMTOOL, "test", "rules", str(RULES_TEST)).stdout
    assert "SUCCESS" in out


def test_rule_unit_tests_catch_a_changed_threshold(tmp_path):
    """The unit tests are not vacuous: the same tests against rules with the duplicate threshold
    raised to 0.1 fail."""
    rules = (GENERATED / "prometheus/rules.yml").read_text()
    assert "trainguard:data_duplicate_ratio:max > 0.05" in rules
    (tmp_path / "generated/prometheus").mkdir(parents=True)
    (tmp_path / "generated/prometheus/rules.yml").write_text(
        rules.replace("trainguard:data_duplicate_ratio:max > 0.05", "trainguard:data_duplicate_ratio:max > 0.1"))
    (tmp_path / "promtool").mkdir()
    shutil.copy(RULES_TEST, tmp_path / "promtool/rules_test.yml")
    done = subprocess.run([PROMTOOL, "test", "rules", str(tmp_path / "promtool/rules_test.yml")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "TrainguardDataDuplicates" in done.stdout + done.stderr


def test_every_alert_rule_has_a_unit_test():
    tests = yaml.safe_load(RULES_TEST.read_text())
    tested = {case["alertname"] for group in tests["tests"] for case in group.get("alert_rule_test", [])
              if case["exp_alerts"]}
    rules = yaml.safe_load((GENERATED / "prometheus/rules.yml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    assert alerts - tested == set()


def _substitute_variables(expr: str) -> str:
    for variable, value in (("$__rate_interval", "1m"), ("$job", ".*"), ("$run", ".*"), ("$rank", ".*")):
        expr = expr.replace(variable, value)
    assert "$" not in expr, expr
    return expr


def test_every_dashboard_query_parses(tmp_path):
    """Each query (variables substituted as Grafana would) becomes a recording rule that promtool
    parses with Prometheus's own PromQL parser."""
    rules = []
    for name in build.DASHBOARDS:
        data = build.dashboard_json(build.DASHBOARDS[name])
        for i, (_, expr) in enumerate(build.dashboard_queries(data)):
            rules.append({"record": f"check:{name.split('.')[0].replace('-', '_')}:q{i}",
                          "expr": _substitute_variables(expr)})
    (tmp_path / "queries.yml").write_text(yaml.safe_dump({"groups": [{"name": "q", "rules": rules}]}))
    out = _run(PROMTOOL, "check", "rules", str(tmp_path / "queries.yml")).stdout
    assert f"SUCCESS: {len(rules)} rules found" in out


@pytest.mark.skipif(AMTOOL is None, reason="amtool not installed (prometheus-alertmanager)")
def test_alertmanager_config_and_routing(tmp_path):
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    config = tmp_path / "alertmanager.yml"
    config.write_text((GENERATED / "alertmanager/alertmanager.yml").read_text().replace(ALERTMANAGER_TOKEN_SECRET, str(token)))
    _run(AMTOOL, "check-config", str(config))
    routed = _run(AMTOOL, "config", "routes", "test", "--config.file", str(config), "--verify.receivers",
                  "trainguard-controller,webhook-sink", "alertname=TrainguardOptimizerStateNonFinite",
                  "trainguard_action=pause", "run=r1").stdout
    assert "trainguard-controller" in routed and "webhook-sink" in routed
    for labels in (["alertname=Other"], ["alertname=TrainguardDataDuplicates", "trainguard_action=notify", "run=r1"]):
        plain = _run(AMTOOL, "config", "routes", "test", "--config.file", str(config), *labels).stdout
        assert plain.split() == ["webhook-sink"], labels
    for action in ("lr_scale", "checkpoint", "stop", "rollback", "memory_trace", "verify"):
        routed = _run(AMTOOL, "config", "routes", "test", "--config.file", str(config),
                      "alertname=X", f"trainguard_action={action}", "run=r1").stdout
        assert sorted(routed.replace(",", " ").split()) == ["trainguard-controller", "webhook-sink"], action


@pytest.mark.skipif(AMTOOL is None, reason="amtool not installed (prometheus-alertmanager)")
def test_only_alerts_no_controller_rule_decides_by_cause_reach_the_controller(tmp_path):
    """The gradient alerts notify people only: the controller's own gradient rules lower the LR by
    cause (a warm restart, a run's scale, unfreezing), and an LR cut from Prometheus too would act
    on healthy runs and twice on one spike. Routed by Alertmanager with the generated labels."""
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    config = tmp_path / "alertmanager.yml"
    config.write_text((GENERATED / "alertmanager/alertmanager.yml").read_text().replace(ALERTMANAGER_TOKEN_SECRET, str(token)))
    rules = yaml.safe_load((GENERATED / "prometheus/rules.yml").read_text())
    reaching = set()
    for rule in (r for g in rules["groups"] for r in g["rules"] if "alert" in r):
        labels = [f"alertname={rule['alert']}", "run=r1", *(f"{k}={v}" for k, v in rule["labels"].items())]
        routed = _run(AMTOOL, "config", "routes", "test", "--config.file", str(config), *labels).stdout
        if "trainguard-controller" in routed:
            reaching.add(rule["alert"])
    assert reaching == {"TrainguardOptimizerStateNonFinite"}
