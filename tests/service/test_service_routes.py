"""Route tests with FastAPI's test client: the agent's and operators' API, auth, bad input."""

from __future__ import annotations

import json
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from trainguard.service.metrics import CONTROLLER_METRICS
from tests.service.conftest import register

pytestmark = pytest.mark.timing

OP, RO, AG, AG_BOUND = "operator-token-1", "readonly-token-1", "agent-token-1", "agent-token-2"
TOKENS = dict(operator_tokens=(OP, f"{RO}:read"), agent_tokens=(AG, f"{AG_BOUND}:run-b"))


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def report_body(step: int = 1, values: dict | None = None, job: str = "job-a", **ranks) -> dict:
    return {"job": job, "step_first": step, "step_last": step, "time": 1.0, "values": values or {}, "ranks": ranks}


def test_register_report_poll_ack_flow(app_factory):
    with app_factory() as c:
        reg = register(c)
        assert reg["desired"] == {"generation": 0, "paused": False, "lr_scale": 1.0, "checkpoint_seq": 0, "stop": False,
                                  "rollback_seq": 0, "rollback_step": 0, "reason": "",
                                  "accumulation_steps": 0, "accumulation_lr_rule": "none",
                                  "memory_trace_seq": 0, "verify_seq": 0, "data_skip_until": 0, "data_skip_from": 0,
                                  "stop_exit_code": 0,
                                  "grad_clip_norm": 0.0, "reset_optimizer_seq": 0, "reset_optimizer_layers": "",
                                  "momentum_scale": 1.0, "weight_decay_scale": 1.0, "verify_float32_seq": 0}
        healthy = report_body(5, {"trainguard_loss": 2.6, "trainguard_grad_norm_max": 4.0})
        assert c.post("/v1/runs/run-1/reports", json=healthy).json()["alerts"] == []
        r = c.post("/v1/runs/run-1/reports", json=report_body(10, {"trainguard_loss": 2.5, "trainguard_grad_norm_max": 3000.0}))
        assert r.status_code == 200
        acc = r.json()
        assert acc["alerts"] == ["grad_norm_high"]
        assert acc["desired"]["generation"] == 1 and acc["desired"]["lr_scale"] == 0.5
        assert c.get("/v1/runs/run-1/desired", params={"after": 0}).json()["generation"] == 1
        assert c.post("/v1/runs/run-1/acks", json={"generation": 1, "step": 11}).json() == {"applied_generation": 1, "applied_step": 11, "recorded": True}
        assert c.post("/v1/runs/run-1/acks", json={"generation": 5, "step": 12}).status_code == 409
        st = c.get("/v1/runs/run-1").json()
        assert st["applied_generation"] == 1 and st["desired_generation"] == 1 and st["last_step"] == 10
        assert st["last_values"] == {"trainguard_loss": 2.5, "trainguard_grad_norm_max": 3000.0}
        assert [a["rule"] for a in st["firing_alerts"]] == ["grad_norm_high"]
        assert st["firing_alerts"][0]["diagnosis"]["source"].startswith("Gradient values above 1e3")
        kinds = [e["kind"] for e in c.get("/v1/runs/run-1/events").json()]
        assert kinds == ["registered", "alert", "desired", "incident", "applied"]  # the LR rung opened an incident
        alerts = c.get("/v1/alerts", params={"state": "firing", "run": "run-1"}).json()
        assert len(alerts) == 1 and alerts[0]["values"]["value"] == 3000.0


def test_nan_and_inf_survive_end_to_end(app_factory):
    with app_factory() as c:
        register(c)
        raw = b'{"job":"job-a","step_first":1,"step_last":1,"time":1.0,"values":{"trainguard_loss":NaN,"x":"Infinity","y":"-Infinity"}}'
        r = c.post("/v1/runs/run-1/reports", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 200 and r.json()["desired"]["paused"] is True
        vals = c.get("/v1/runs/run-1").json()["last_values"]
        assert vals == {"trainguard_loss": "NaN", "x": "Infinity", "y": "-Infinity"}
        alert = c.get("/v1/alerts").json()[0]
        assert alert["values"]["nonfinite"]["trainguard_loss"] == "NaN"


def test_reregistration_keeps_desired_state_and_history(app_factory):
    with app_factory() as c:
        register(c)
        c.post("/v1/runs/run-1/reports", json=report_body(1, {"trainguard_loss": 1.0}))
        assert c.post("/v1/runs/run-1/pause", json={"reason": "look"}).status_code == 200
        again = register(c, world_size=8)
        assert again["desired"]["paused"] is True and again["desired"]["generation"] == 1
        st = c.get("/v1/runs/run-1").json()
        assert st["world_size"] == 8 and st["reports"] == 1
        bad = c.post("/v1/runs", json={"job": "other-job", "run": "run-1", "world_size": 1})
        assert bad.status_code == 409


def test_commands_and_idempotency(app_factory):
    with app_factory() as c:
        register(c)
        key = {"Idempotency-Key": "k-1"}
        first = c.post("/v1/runs/run-1/pause", json={"reason": "why"}, headers=key)
        again = c.post("/v1/runs/run-1/pause", json={"reason": "why"}, headers=key)
        assert first.status_code == again.status_code == 200 and first.json() == again.json()
        assert first.json()["desired"]["generation"] == 1
        other = c.post("/v1/runs/run-1/pause", json={"reason": "different"}, headers=key)
        assert other.status_code == 409
        # A repeat without a key on an already-paused run changes nothing.
        assert c.post("/v1/runs/run-1/pause", json={"reason": "x"}).json()["changed"] is False
        assert c.post("/v1/runs/run-1/checkpoint", json={}).json()["desired"]["checkpoint_seq"] == 1
        assert c.post("/v1/runs/run-1/lr-scale", json={"scale": 0.25, "reason": "r"}).json()["desired"]["lr_scale"] == 0.25
        stop = c.post("/v1/runs/run-1/stop", json={"reason": "done"}).json()["desired"]
        assert stop["stop"] and stop["generation"] == 4
        resumed = c.post("/v1/runs/run-1/resume").json()["desired"]
        assert (resumed["paused"], resumed["stop"], resumed["generation"], resumed["lr_scale"]) == (False, False, 5, 0.25)
        events = [e for e in c.get("/v1/runs/run-1/events").json() if e["kind"] == "desired"]
        assert [e["generation"] for e in events] == [1, 2, 3, 4, 5]
        assert events[0]["reason"] == "why" and events[0]["actor"] == "anonymous"
        assert c.post("/v1/runs/nope/pause", json={}).status_code == 404


def test_long_poll_wakes_on_change_without_blocking(app_factory):
    with app_factory() as c:
        register(c)
        out = {}

        def poll():
            t0 = time.monotonic()
            out["state"] = c.get("/v1/runs/run-1/desired", params={"after": 0, "wait": 30}).json()
            out["elapsed"] = time.monotonic() - t0

        th = threading.Thread(target=poll)
        th.start()
        time.sleep(0.3)
        assert "state" not in out  # still waiting, and the loop still serves other requests:
        assert c.get("/v1/runs/run-1").json()["desired_generation"] == 0
        c.post("/v1/runs/run-1/pause", json={"reason": "now"})
        th.join(20)
        assert out["state"]["generation"] == 1 and out["state"]["paused"] is True
        assert out["elapsed"] < 15  # woke on the change, long before the 30 s wait ran out
        # Nothing newer: answers the current state when the wait runs out.
        assert c.get("/v1/runs/run-1/desired", params={"after": 1, "wait": 0.1}).json()["generation"] == 1


def test_auth_matrix(app_factory):
    with app_factory(**TOKENS) as c:
        assert c.get("/healthz").status_code == 200
        assert c.get("/v1/runs").status_code == 401
        assert c.get("/v1/runs", headers=bearer("wrong-token-xyz")).status_code == 401
        assert c.get("/v1/runs", headers={"Authorization": f"Basic {OP}"}).status_code == 401
        reg = {"job": "job-a", "run": "run-a", "world_size": 1}
        assert c.post("/v1/runs", json=reg, headers=bearer(OP)).status_code == 403  # operators are not agents
        assert c.post("/v1/runs", json=reg, headers=bearer(AG)).status_code == 200  # binds AG to run-a
        assert c.post("/v1/runs", json=reg | {"run": "run-x"}, headers=bearer(AG)).status_code == 403
        assert c.post("/v1/runs", json=reg | {"run": "run-b"}, headers=bearer(AG_BOUND)).status_code == 200
        assert c.post("/v1/runs/run-b/reports", json=report_body(), headers=bearer(AG)).status_code == 403
        assert c.post("/v1/runs/run-a/reports", json=report_body(), headers=bearer(AG_BOUND)).status_code == 403
        assert c.post("/v1/runs/run-a/reports", json=report_body(), headers=bearer(AG)).status_code == 200
        assert c.get("/v1/runs/run-a/desired", headers=bearer(AG)).status_code == 200
        assert c.get("/v1/runs/run-a/desired", headers=bearer(RO)).status_code == 200
        assert c.get("/v1/runs", headers=bearer(AG)).status_code == 403
        assert c.post("/v1/runs/run-a/pause", json={}, headers=bearer(AG)).status_code == 403
        assert c.post("/v1/runs/run-a/pause", json={}, headers=bearer(RO)).status_code == 403
        assert c.get("/v1/runs", headers=bearer(RO)).status_code == 200
        assert c.put("/v1/rules", content="rules: []", headers=bearer(RO)).status_code == 403
        assert c.get("/v1/webhooks", headers=bearer(RO)).status_code == 403
        r = c.post("/v1/runs/run-a/pause", json={"reason": "x"}, headers=bearer(OP))
        assert r.status_code == 200
        actor = [e for e in c.get("/v1/runs/run-a/events", headers=bearer(OP)).json() if e["kind"] == "desired"][0]["actor"]
        assert actor.startswith("operator:") and OP not in actor


def test_refuses_network_bind_without_tokens(tmp_path):
    from pydantic import ValidationError

    from trainguard.service.config import Settings

    with pytest.raises(ValidationError, match="refusing to bind"):
        Settings(host="0.0.0.0", db=tmp_path / "x.db")
    assert Settings(host="0.0.0.0", db=tmp_path / "x.db", operator_tokens=(OP,)).auth_enabled


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/runs", {"job": "j", "run": "r", "world_size": "four"}),
        ("/v1/runs", {"job": "j", "world_size": 1}),
        ("/v1/runs", {"job": "bad name!", "run": "r", "world_size": 1}),
        ("/v1/runs", {"job": "j", "run": "r", "world_size": 0}),
        ("/v1/runs", {"job": "j", "run": "r", "world_size": 2, "ranks": [{"rank": 5, "local_rank": 0, "host": "h", "port": 1}]}),
        ("/v1/runs", {"job": "j", "run": "r", "world_size": 1, "surprise": 1}),
        ("/v1/runs/run-1/reports", {"job": "job-a", "step_first": 1}),
        ("/v1/runs/run-1/reports", {"job": "job-a", "step_first": 5, "step_last": 4, "time": 1.0}),
        ("/v1/runs/run-1/reports", {"job": "job-a", "step_first": 1, "step_last": 1, "time": "NaN"}),
        ("/v1/runs/run-1/reports", {"job": "job-a", "step_first": 1, "step_last": 1, "time": 1.0, "values": {"a": "lots"}}),
        ("/v1/runs/run-1/reports", {"job": "job-a", "step_first": 1, "step_last": 1, "time": 1.0, "ranks": {"loss": [1.0]}}),
        ("/v1/runs/run-1/reports", [1, 2, 3]),
        ("/v1/runs/run-1/acks", {"generation": -1, "step": 0}),
        ("/v1/runs/run-1/lr-scale", {"scale": "NaN"}),
        ("/v1/runs/run-1/lr-scale", {"scale": 0}),
        ("/v1/runs/run-1/lr-scale", {"scale": 1e9}),
        ("/v1/runs/run-1/lr-scale", {"reason": "no scale"}),
        ("/v1/runs/run-1/pause", {"reason": 5}),
        ("/v1/webhooks", {"url": "ftp://x.example/hook"}),
        ("/v1/webhooks", {"url": "http://127.0.0.1:1/x", "secret": "short"}),
        ("/v1/alertmanager", {"version": "3", "alerts": []}),
        ("/v1/rules/test", {"reports": "nope"}),
    ],
)
def test_malformed_input_is_4xx(app_factory, path, body):
    with app_factory() as c:
        register(c)
        r = c.post(path, json=body)
        assert 400 <= r.status_code < 500, (r.status_code, r.text)
        assert "detail" in r.json()


def test_malformed_bytes_and_huge_bodies(app_factory):
    from trainguard.service.limits import report_body_bytes

    with app_factory(max_body_bytes=32 * 1024, max_world_size=4) as c:
        register(c)
        for raw in (b"{not json", b"\xff\xfe\x00", b"", b"null", b'{"job": "job-a", "step_first": 1e400}'):
            r = c.post("/v1/runs/run-1/reports", content=raw, headers={"content-type": "application/json"})
            assert 400 <= r.status_code < 500, (raw, r.status_code)
        # A report may be as large as the largest a run of max_world_size ranks sends; past that, 413.
        limit = max(32 * 1024, report_body_bytes(4))
        huge = json.dumps(report_body(values={f"m{i}": 1.0 for i in range(limit // 10)})).encode()
        assert len(huge) > limit
        r = c.post("/v1/runs/run-1/reports", content=huge, headers={"content-type": "application/json"})
        assert r.status_code == 413
        chunked = c.post("/v1/runs/run-1/reports", content=iter([huge[:20000], huge[20000:]]), headers={"content-type": "application/json"})
        assert chunked.status_code == 413
        assert c.put("/v1/rules", content=b"\xff\xfe").status_code == 422
        # The controller is still healthy and answers normally afterwards.
        assert c.post("/v1/runs/run-1/reports", json=report_body()).status_code == 200


def test_report_checks_run_job_and_vector_lengths(app_factory):
    with app_factory() as c:
        register(c, world_size=4)
        assert c.post("/v1/runs/ghost/reports", json=report_body()).status_code == 404
        assert c.post("/v1/runs/run-1/reports", json=report_body(job="other")).status_code == 409
        assert c.post("/v1/runs/run-1/reports", json=report_body(loss=[1.0, 2.0])).status_code == 422
        assert c.post("/v1/runs/run-1/reports", json=report_body(loss=[1.0, 2.0, 3.0, 4.0])).status_code == 200


def test_rules_get_put_test(app_factory):
    with app_factory() as c:
        assert c.get("/v1/rules").json()["source"] == "default"
        bad = c.put("/v1/rules", content="rules: [{name: a, kind: threshold, metric: m, op: '>'}]")
        assert bad.status_code == 422 and any("value" in r for r in bad.json()["reasons"])
        assert c.get("/v1/rules").json()["source"] == "default"  # old rules stay
        text = "rules:\n  - {name: big, kind: threshold, metric: trainguard_gpu_temperature_celsius, op: '>', value: 10, actions: [pause]}\n"
        ok = c.put("/v1/rules", content=text, headers={"content-type": "application/yaml"})
        assert ok.status_code == 200 and ok.json()["source"] == "api" and ok.json()["text"] == text
        register(c)
        assert c.post("/v1/runs/run-1/reports", json=report_body(values={"trainguard_gpu_temperature_celsius": 11.0})).json()["alerts"] == ["big"]
        # /rules/test: no side effects.
        reps = [report_body(i, {"trainguard_grad_norm_max": v}) | {"time": float(i)} for i, v in enumerate([1.0, 5000.0])]
        res = c.post("/v1/rules/test", json={"rules": None, "reports": reps, "world_size": 4}).json()
        assert res["steps"][1]["fired"] == []  # the active rules no longer have grad_norm_high
        from trainguard.service.rules import default_rules_text

        res = c.post("/v1/rules/test", json={"rules": default_rules_text(), "reports": reps, "world_size": 4}).json()
        assert [f["rule"] for f in res["steps"][1]["fired"]] == ["grad_norm_high"]
        assert res["desired"]["lr_scale"] == 0.5
        assert c.get("/v1/runs/run-1").json()["desired_generation"] == 1
        bad_test = c.post("/v1/rules/test", json={"rules": "rules: [{kind: x}]", "reports": []})
        assert bad_test.status_code == 422
    # Stored rules survive a restart (no --rules file given).
    with app_factory() as c:
        assert c.get("/v1/rules").json()["text"] == text


def test_alertmanager_webhook_in_acts_once(app_factory):
    with app_factory() as c:
        register(c)
        alert = {"status": "firing", "labels": {"alertname": "LossHigh", "run": "run-1", "trainguard_action": "pause"},
                 "annotations": {"summary": "loss too high"}, "startsAt": "2026-01-01T00:00:00Z", "fingerprint": "abc123"}
        payload = {"version": "4", "status": "firing", "receiver": "trainguard", "groupLabels": {}, "commonLabels": {},
                   "commonAnnotations": {}, "externalURL": "", "groupKey": "{}", "truncatedAlerts": 0, "alerts": [alert]}
        first = c.post("/v1/alertmanager", json=payload).json()["results"]
        assert [r["outcome"] for r in first] == ["applied"]
        assert c.post("/v1/alertmanager", json=payload).json()["results"][0]["outcome"] == "duplicate"
        lr = dict(alert, fingerprint="def456", labels=alert["labels"] | {"trainguard_action": "lr_scale", "trainguard_lr_scale": "0.3"})
        unknown = dict(alert, fingerprint="x1", labels=alert["labels"] | {"run": "ghost"})
        resolved = dict(alert, status="resolved", fingerprint="x2")
        res = c.post("/v1/alertmanager", json=payload | {"alerts": [lr, unknown, resolved]}).json()["results"]
        assert [r["outcome"] for r in res] == ["applied", "error", "ignored"]
        st = c.get("/v1/runs/run-1").json()["desired"]
        assert st["paused"] and st["lr_scale"] == 0.3 and st["generation"] == 2
        actors = [e["actor"] for e in c.get("/v1/runs/run-1/events").json() if e["kind"] == "desired"]
        assert actors == ["alertmanager:LossHigh"] * 2


def test_sd_targets_and_metrics_catalogue(app_factory):
    with app_factory() as c:
        register(c, world_size=2)
        c.post("/v1/runs/run-1/reports", json=report_body(1, values={"trainguard_grad_norm_max": 5.0}))
        c.post("/v1/runs/run-1/reports", json=report_body(2, values={"trainguard_grad_norm_max": 5000.0}))
        assert c.get("/v1/sd/targets").json() == [
            {"targets": ["127.0.0.1:9100"], "labels": {"job": "job-a", "run": "run-1", "rank": "0"}},
            {"targets": ["127.0.0.1:9101"], "labels": {"job": "job-a", "run": "run-1", "rank": "1"}},
        ]
        text = c.get("/metrics").text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        ours = {n for n in families if n.startswith("trainguard_controller_") and not n.endswith("_created")}
        catalogue = {m.name.removesuffix("_total") for m in CONTROLLER_METRICS}
        assert ours == catalogue
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
        assert samples[("trainguard_controller_reports_total", ())] == 2
        assert samples[("trainguard_controller_alerts_total", (("rule", "grad_norm_high"), ("severity", "warning")))] == 1
        assert samples[("trainguard_controller_actions_total", (("action", "lr_scale"), ("source", "rule")))] == 1
        assert samples[("trainguard_controller_ingest_latency_seconds_count", ())] == 2
        assert c.get("/openapi.json").json()["paths"]["/v1/runs/{run}/reports"]["post"]["requestBody"]
        assert c.get("/docs").status_code == 200


def test_sd_targets_list_an_endpoint_shared_by_ranks_once(app_factory):
    # Ranks 3, 1 and 2 registered one host:port (the loopback metrics_host on every node, host
    # names differing in case only): Prometheus would scrape that one process as three ranks.
    hosts = {0: ("10.0.0.5", 9100), 3: ("node-a", 9100), 1: ("NODE-A", 9100), 2: ("node-a", 9100)}
    ranks = [{"rank": r, "local_rank": 0, "host": h, "port": p} for r, (h, p) in hosts.items()]
    with app_factory() as c:
        for run in ("run-1", "run-2"):
            body = {"job": "job-a", "run": run, "world_size": 4, "agent_version": "test", "ranks": ranks}
            assert c.post("/v1/runs", json=body).status_code == 200
        targets = c.get("/v1/sd/targets").json()
    assert targets == [
        {"targets": [address], "labels": {"job": "job-a", "run": run, "rank": rank}}
        for run in ("run-1", "run-2") for address, rank in (("10.0.0.5:9100", "0"), ("NODE-A:9100", "1"))
    ]


def test_absence_ticker_with_injected_clock(app_factory):
    now = [10_000.0]
    with app_factory(clock=lambda: now[0], tick_s=0.02) as c:
        register(c)
        now[0] += 301.0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and c.get("/v1/runs/run-1").json()["status"] != "silent":
            time.sleep(0.02)
        st = c.get("/v1/runs/run-1").json()
        assert st["status"] == "silent" and st["firing"] == ["run_silent"]
        assert st["firing_alerts"][0]["values"]["silent_s"] == pytest.approx(301.0)
        c.post("/v1/runs/run-1/reports", json=report_body())
        assert c.get("/v1/runs/run-1").json()["firing"] == []
        assert c.get("/v1/alerts", params={"state": "resolved"}).json()[0]["rule"] == "run_silent"


def test_preflight_result_is_shown_in_the_run_status_and_recorded(app_factory):
    body = {"rank": 0, "seconds": 0.25, "checks": [
        {"name": "nonfinite", "status": "pass", "detail": "finite"},
        {"name": "adam_eps", "status": "warn", "detail": "eps 1e-6 on 13B"},
        {"name": "ranks_agree", "status": "fail", "detail": "layer 'blocks.3' on rank(s) [1]"}]}
    with app_factory() as c:
        register(c)
        r = c.post("/v1/runs/run-1/preflight", json=body)
        assert r.status_code == 200 and r.json()["counts"] == {"pass": 1, "warn": 1, "fail": 1, "skip": 0}
        shown = c.get("/v1/runs/run-1").json()["preflight"]
        assert [ch["status"] for ch in shown["checks"]] == ["pass", "warn", "fail"] and shown["seconds"] == 0.25
        (event,) = [e for e in c.get("/v1/runs/run-1/events").json() if e["kind"] == "preflight"]
        assert "1 failed" in event["reason"] and "ranks_agree" in event["reason"]
        assert c.post("/v1/runs/run-1/preflight", json=body | {"checks": [{"name": "x", "status": "maybe"}]}).status_code == 422
        assert c.post("/v1/runs/nope/preflight", json=body).status_code == 404
