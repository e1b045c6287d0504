"""Alertmanager's actions (service.alertmanager) go through the rules' own action code: an LR
factor is clamped to [LR_SCALE_MIN, LR_SCALE_MAX] exactly as a rule's is."""

from __future__ import annotations

from trainguard.protocol.wire import LR_SCALE_MIN, LrScaleRequest
from trainguard.service.alertmanager import DEFAULT_LR_FACTOR, parse_alert
from tests.service.conftest import register


def _payload(*alerts: dict) -> dict:
    return {"version": "4", "status": "firing", "receiver": "trainguard", "groupLabels": {}, "commonLabels": {},
            "commonAnnotations": {}, "externalURL": "", "groupKey": "{}", "truncatedAlerts": 0, "alerts": list(alerts)}


def _halve(i: int) -> dict:
    return {"status": "firing", "labels": {"alertname": "GradNormHigh", "run": "run-1", "trainguard_action": "lr_scale"},
            "annotations": {"summary": "grad norm high"}, "startsAt": f"2026-01-01T00:{i // 60:02d}:{i % 60:02d}Z",
            "fingerprint": "grad-norm-high"}


def test_repeated_alertmanager_halvings_stop_at_the_floor(app_factory) -> None:
    with app_factory() as c:
        register(c)
        expected, generation = 1.0, 0
        for i in range(20):
            res = c.post("/v1/alertmanager", json=_payload(_halve(i))).json()["results"]
            assert [r["outcome"] for r in res] == ["applied"]
            new = max(expected * DEFAULT_LR_FACTOR, LR_SCALE_MIN)  # the rule path's clamp, computed here
            generation += new != expected
            expected = new
            desired = c.get("/v1/runs/run-1").json()["desired"]
            assert desired["lr_scale"] == expected and desired["generation"] == generation
        assert expected == LR_SCALE_MIN and generation == 14  # 0.5**13 > 1e-4 > 0.5**14


def test_one_spelling_of_the_lr_command() -> None:
    res, cmd = parse_alert(_halve(0) | {"labels": _halve(0)["labels"] | {"trainguard_action": "lr-scale"}})
    assert cmd is None and res["outcome"] == "error" and "lr_scale" in res["detail"]
    res, cmd = parse_alert(_halve(0) | {"labels": _halve(0)["labels"] | {"trainguard_lr_factor": "0.25"}})
    assert cmd is not None and (cmd.command, cmd.params) == ("lr_scale", LrScaleRequest(factor=0.25))


def test_operator_scale_outside_the_range_is_refused(app_factory) -> None:
    with app_factory() as c:
        register(c)
        assert c.post("/v1/runs/run-1/lr-scale", json={"scale": LR_SCALE_MIN / 2}).status_code == 422
        r = c.post("/v1/runs/run-1/lr-scale", json={"scale": LR_SCALE_MIN})
        assert r.status_code == 200 and r.json()["command"] == "lr_scale" and r.json()["desired"]["lr_scale"] == LR_SCALE_MIN


def test_alerts_ask_the_agents_for_a_diagnosis(app_factory) -> None:
    """``trainguard_action`` memory_trace / verify raise the run's sequence numbers, once per
    alert, with the alert named as the reason; a repeat of the same alert changes nothing."""
    with app_factory() as c:
        register(c)
        for action, field in (("memory_trace", "memory_trace_seq"), ("verify", "verify_seq")):
            alert = {"status": "firing", "labels": {"alertname": f"Check{action}", "run": "run-1", "trainguard_action": action},
                     "annotations": {"summary": f"please {action}"}, "startsAt": "2026-01-01T00:00:00Z", "fingerprint": action}
            before = c.get("/v1/runs/run-1").json()["desired"]
            res = c.post("/v1/alertmanager", json=_payload(alert)).json()["results"]
            assert [r["outcome"] for r in res] == ["applied"], res
            after = c.get("/v1/runs/run-1").json()["desired"]
            assert after[field] == before[field] + 1 and after["generation"] == before["generation"] + 1
            assert after["reason"] == f"alertmanager Check{action}: please {action}"
            assert {k: v for k, v in after.items() if k not in (field, "generation", "reason")} == \
                {k: v for k, v in before.items() if k not in (field, "generation", "reason")}
            res = c.post("/v1/alertmanager", json=_payload(alert)).json()["results"]
            assert [r["outcome"] for r in res] == ["duplicate"]
            assert c.get("/v1/runs/run-1").json()["desired"] == after


def _alert(action: str, fingerprint: str, **labels: str) -> dict:
    return {"status": "firing", "labels": {"alertname": "Optimizer", "run": "run-1", "trainguard_action": action, **labels},
            "annotations": {"summary": f"{action} please"}, "startsAt": "2026-01-01T00:00:00Z", "fingerprint": fingerprint}


def test_alerts_give_the_optimizer_commands_with_their_bodies_from_labels(app_factory) -> None:
    """Each optimizer command's body comes from ``trainguard_<field>`` labels; each alert acts once."""
    with app_factory() as c:
        register(c)
        cases = [
            (_alert("grad_clip", "a", trainguard_max_norm="2.5"), {"grad_clip_norm": 2.5}),
            (_alert("reset_optimizer", "b"), {"reset_optimizer_seq": 1}),
            (_alert("reset_optimizer", "c", trainguard_layers="encoder.0, head"),
             {"reset_optimizer_seq": 2, "reset_optimizer_layers": "encoder.0,head"}),
            (_alert("momentum", "d", trainguard_factor="0.5"), {"momentum_scale": 0.5}),
            (_alert("weight_decay_scale", "e", trainguard_scale="3"), {"weight_decay_scale": 3.0}),
        ]
        for alert, changed in cases:
            before = c.get("/v1/runs/run-1").json()["desired"]
            res = c.post("/v1/alertmanager", json=_payload(alert)).json()["results"]
            assert [r["outcome"] for r in res] == ["applied"], res
            after = c.get("/v1/runs/run-1").json()["desired"]
            assert {k: v for k, v in after.items() if v != before[k] and k != "reason"} == changed | {
                "generation": before["generation"] + 1}
            assert after["reason"].startswith(f"alertmanager Optimizer: {alert['labels']['trainguard_action']} please")
            assert [r["outcome"] for r in c.post("/v1/alertmanager", json=_payload(alert)).json()["results"]] == ["duplicate"]


def test_a_label_that_does_not_validate_is_the_alerts_error_and_changes_nothing(app_factory) -> None:
    with app_factory() as c:
        register(c)
        before = c.get("/v1/runs/run-1").json()["desired"]
        alerts = [_alert("grad_clip", "x1", trainguard_max_norm="lots"), _alert("grad_clip", "x2"),
                  _alert("momentum", "x3", trainguard_scale="0.5", trainguard_factor="2"),
                  _alert("weight_decay_scale", "x4", trainguard_scale="1e9"), _alert("rollback", "x5")]
        res = c.post("/v1/alertmanager", json=_payload(*alerts)).json()["results"]
        assert [r["outcome"] for r in res] == ["error"] * 5
        assert res[0]["detail"] == "grad_clip from the labels trainguard_max_norm: max_norm: Input should be a valid number"
        assert res[1]["detail"] == "grad_clip from the labels trainguard_max_norm: max_norm: Field required"
        assert "give exactly one of 'scale' (absolute) or 'factor'" in res[2]["detail"]
        assert res[3]["detail"].endswith("scale: Input should be less than or equal to 100")
        assert res[4]["detail"].startswith("rollback refused: the run reports no snapshot")  # refused: 409's reason
        assert c.get("/v1/runs/run-1").json()["desired"] == before
        # a refused alert was not marked as acted on: once the labels are right it acts
        fixed = _alert("grad_clip", "x1", trainguard_max_norm="1.0")
        assert [r["outcome"] for r in c.post("/v1/alertmanager", json=_payload(fixed)).json()["results"]] == ["applied"]


def test_accumulation_is_not_an_alertmanager_action() -> None:
    res, cmd = parse_alert(_alert("accumulation", "acc", trainguard_steps="4"))
    assert cmd is None and res["outcome"] == "error" and "unknown action 'accumulation'" in res["detail"]


def test_an_alert_firing_longer_than_the_keys_retention_still_acts_once(store_db) -> None:
    """Alertmanager sends a firing alert again every repeat_interval (4 h by default) for as long
    as it fires, with the same startsAt. Each repeat refreshes the key's sight, so that neither the
    hourly prune (keys kept 7 days) nor a restart (which reads the keys of the last 7 days back)
    makes the alert of day 1 act again on day 10."""
    from fastapi.testclient import TestClient

    from trainguard.service.app import create_app
    from trainguard.service.config import Settings

    day, now = 86400.0, [1_000_000.0]
    settings = Settings(db=store_db, tick_s=60)
    with TestClient(create_app(settings, clock=lambda: now[0])) as c:
        register(c, world_size=1)
        c.portal.call(c.app.state.controller.tick)  # (the start's prune)
        results = []
        for step in range(10 * 6):  # ten days of repeats every 4 hours, each hour's prune between them
            report = {"job": "job-a", "step_first": step, "step_last": step, "time": now[0], "values": {"trainguard_loss": 1.0}}
            assert c.post("/v1/runs/run-1/reports", json=report).status_code == 200  # (a run that trains, not removed)
            results.append(c.post("/v1/alertmanager", json=_payload(_halve(0))).json()["results"][0]["outcome"])
            for _ in range(4):
                now[0] += 3601
                c.portal.call(c.app.state.controller.tick)
        assert results == ["applied"] + ["duplicate"] * 59
        desired = c.get("/v1/runs/run-1").json()["desired"]
    assert now[0] > 1_000_000.0 + 10 * day
    with TestClient(create_app(settings, clock=lambda: now[0])) as c:
        assert c.post("/v1/alertmanager", json=_payload(_halve(0))).json()["results"][0]["outcome"] == "duplicate"
        assert c.get("/v1/runs/run-1").json()["desired"] == desired
