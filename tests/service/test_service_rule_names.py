"""service/rule_names.py: a rule that reads a name no report carries is refused where rules come in
(``PUT /v1/rules``, ``trainguard rules check``), naming the closest known names; the shipped rules
read only known names; rules stored before the check still load after a restart."""

from __future__ import annotations

import logging
import sqlite3

import pytest

from trainguard import cli
from trainguard.protocol.catalog import BY_NAME
from trainguard.service.rule_names import RULE_METRICS, RULE_VECTORS
from trainguard.service.rules import RulesError, default_rules_text, load_rules

TYPO = "rules:\n  - {name: grad_high, kind: threshold, metric: trainguard_grad_nrom, op: '>', value: 100}\n"
TYPO_REASON = ("rules.0.threshold.metric: unknown metric 'trainguard_grad_nrom': no report carries it, so a rule on it "
               "never fires; the closest known: trainguard_grad_norm, trainguard_grad_norm_max")


def _reasons(text: str) -> list[str]:
    with pytest.raises(RulesError) as info:
        load_rules(text, check_names=True)
    return info.value.reasons


def test_the_names_rules_read_are_the_unlabelled_catalogue_metrics_and_the_rank_vectors() -> None:
    assert set(RULE_METRICS) == {n for n, s in BY_NAME.items() if not s.labels}
    assert "trainguard_update_ratio_per_lr" in RULE_METRICS and "trainguard_layer_grad_norm" not in RULE_METRICS
    assert "step_time_s" in RULE_VECTORS and "micro_sq_sum" not in RULE_VECTORS


def test_the_shipped_rules_read_only_known_names() -> None:
    rules = load_rules(default_rules_text(), check_names=True)
    assert len(rules.base) > 20


def test_a_metric_typo_names_the_closest_known_metrics() -> None:
    assert _reasons(TYPO) == [TYPO_REASON]
    load_rules(TYPO)  # without the check (rules stored before it): loads


@pytest.mark.parametrize("rule, reason", [
    ("{name: a, kind: threshold, metric: zzz, op: '>', value: 1}",
     "rules.0.threshold.metric: unknown metric 'zzz': no report carries it, so a rule on it never fires"),
    ("{name: a, kind: threshold, metric: trainguard_layer_grad_norm, op: '>', value: 1}",
     "rules.0.threshold.metric: metric 'trainguard_layer_grad_norm' has the label(s) layer: reports carry only metrics "
     "without labels, so a rule on it never fires; the closest known: trainguard_grad_norm"),
    ("{name: a, kind: rate, metric: trainguard_amp_skipped_steps_total, per: trainguard_stpe, value: 0.1}",
     "rules.0.rate.per: unknown metric 'trainguard_stpe': no report carries it, so a rule on it never fires; the "
     "closest known: trainguard_step"),
    ("{name: a, kind: absence, actions: [{type: adaptive_lr, metric: trainguard_update_ratio_per_l}]}",
     "rules.0.absence.actions.0.adaptive_lr.metric: unknown metric 'trainguard_update_ratio_per_l': no report carries "
     "it, so a rule on it never fires; the closest known: trainguard_update_ratio_per_lr, trainguard_update_ratio"),
    ("{name: a, kind: cross_rank, vector: step_time, check: spread}",
     "rules.0.cross_rank.vector: unknown per-rank vector 'step_time'; the closest known: step_time_s"),
    ("{name: a, kind: nonfinite, vectors: [loss, '{x}']}",
     "rules.0.nonfinite.vectors.1: unknown per-rank vector '{x}'; known: " + ", ".join(RULE_VECTORS)),
])
def test_each_refusal_says_what_is_unknown_and_what_is_close(rule: str, reason: str) -> None:
    assert _reasons(f"rules: [{rule}]") == [reason]


def test_the_recovery_metric_and_a_jobs_override_are_checked_too() -> None:
    assert _reasons("recovery: {metric: trainguard_update_ratoi}\n") == [
        "recovery.metric: unknown metric 'trainguard_update_ratoi': no report carries it, so a rule on it never fires; "
        "the closest known: trainguard_update_ratio, trainguard_update_size_ratio, trainguard_update_ratio_per_lr"]
    override = ("rules: [{name: a, kind: threshold, metric: trainguard_loss, op: '>', value: 1}]\n"
                "jobs: {llm: [{name: a, metric: trainguard_los}]}\n")
    assert _reasons(override) == [
        "jobs.llm[0] (a): threshold.metric: unknown metric 'trainguard_los': no report carries it, so a rule on it "
        "never fires; the closest known: trainguard_loss"]


def test_put_rules_refuses_a_typo_with_422_and_keeps_the_active_rules(app_factory) -> None:
    with app_factory() as c:
        r = c.put("/v1/rules", content=TYPO, headers={"content-type": "application/yaml"})
        assert r.status_code == 422 and r.json()["reasons"] == [TYPO_REASON]
        assert c.get("/v1/rules").json()["source"] == "default"
        fixed = TYPO.replace("trainguard_grad_nrom", "trainguard_grad_norm")
        assert c.put("/v1/rules", content=fixed).status_code == 200


def test_rules_stored_before_the_check_load_after_a_restart_and_are_logged(app_factory, tmp_path, caplog) -> None:
    with app_factory() as c:
        assert c.get("/v1/rules").json()["source"] == "default"
    conn = sqlite3.connect(tmp_path / "tg.db", isolation_level=None)
    conn.execute("INSERT INTO rules_versions (text, source, actor, created_at) VALUES (?, 'api', 'alice', 1.0)", (TYPO,))
    conn.close()
    with caplog.at_level(logging.WARNING, logger="trainguard.controller"), app_factory() as c:
        body = c.get("/v1/rules").json()
        assert body["text"] == TYPO and body["source"] == "api"
    assert f"the stored rules read names no report carries, so these rules never fire: {TYPO_REASON}" in caplog.messages


def test_rules_check_exits_1_naming_the_closest_metric(tmp_path, capsys) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(TYPO)
    assert cli.main(["rules", "check", str(path)]) == 1
    assert capsys.readouterr().err == f"{path}: invalid rules: {TYPO_REASON}\n"
    path.write_text(default_rules_text())
    assert cli.main(["rules", "check", str(path)]) == 0
