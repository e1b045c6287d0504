"""Run lifecycle: ``POST /v1/runs/{run}/finish`` and the absence rule's clock.

A finished run is not expected to report, so the absence ticker must not page anyone about it; a
run that was paused (or stopped) for longer than the absence limit must not be reported silent
right after it is resumed. A genuinely silent live run still is (the negative control in each
test). Time is the injected clock; the ticker runs every 20 ms of real time.
"""

from __future__ import annotations

import json

import pytest

from trainguard.service.evaluate import evaluate
from trainguard.service.rules import AbsenceRule
from trainguard.service.window import RunWindow
from tests.service.conftest import register, rule_evaluations, wait_until

OP, AG, AG_BOUND = "operator-token-9", "agent-token-9", "agent-token-bound-9"
TOKENS = dict(operator_tokens=(OP,), agent_tokens=(AG, f"{AG_BOUND}:run-b"))
T0 = 50_000.0


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def report(step: int) -> dict:
    return {"job": "job-a", "step_first": step, "step_last": step, "time": 1.0, "values": {"trainguard_loss": 1.0}}


def status(c, run: str) -> dict:  # type: ignore[no-untyped-def]
    return c.get(f"/v1/runs/{run}").json()


# -- the rule itself (pure) ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("last_report", "live_since", "now", "active", "silent"),
    [
        (0.0, None, 299.0, False, 299.0),      # no live_since: silence since the last report
        (0.0, None, 300.0, True, 300.0),       # exactly the limit fires (>=)
        (0.0, 3_600.0, 3_899.0, False, 299.0),  # resumed at 3600: the old report does not count
        (0.0, 3_600.0, 3_900.0, True, 300.0),
        (5_000.0, 3_600.0, 5_299.0, False, 299.0),  # a report after the resume is the later one
        (5_000.0, 3_600.0, 5_300.0, True, 300.0),
    ],
)
def test_absence_counts_from_the_later_of_last_report_and_live_since(last_report, live_since, now, active, silent):
    window = RunWindow(capacity=4, rank_capacity=2, world_size=1, created=last_report)
    rule = AbsenceRule(name="quiet", kind="absence", seconds=300.0, severity="warning", actions=[{"type": "notify"}])
    (finding,) = evaluate((rule,), window, now) if live_since is None else evaluate((rule,), window, now, live_since=live_since)
    assert finding.active is active
    if not active:
        return  # (a finding that fires nothing carries no values)
    assert finding.values["silent_s"] == silent
    assert finding.values["silent_since"] == (last_report if live_since is None else max(last_report, live_since))
    assert finding.values["last_report_at"] == last_report


# -- the route ----------------------------------------------------------------------------------
def test_finish_marks_the_run_finished_once(app_factory):
    now = [T0]
    with app_factory(clock=lambda: now[0], **TOKENS) as c:
        register(c, headers=bearer(AG))
        assert c.post("/v1/runs/run-1/reports", json=report(10), headers=bearer(AG)).status_code == 200
        assert len(c.get("/v1/sd/targets", headers=bearer(OP)).json()) >= 1  # live: its ranks are targets
        now[0] += 7.0
        r = c.post("/v1/runs/run-1/finish", json={"step": 12, "reason": "completed"}, headers=bearer(AG))
        assert r.status_code == 200, r.text
        assert r.json() == {"run": "run-1", "status": "finished", "finished_at": T0 + 7.0, "finished_step": 12,
                            "finish_reason": "completed", "changed": True}
        now[0] += 5.0
        again = c.post("/v1/runs/run-1/finish", json={"step": 99, "reason": "other"}, headers=bearer(AG))
        assert again.status_code == 200 and again.json() == r.json() | {"changed": False}  # the first finish is kept
        (listed,) = c.get("/v1/runs", params={"status": "finished"}, headers=bearer(OP)).json()
        assert (listed["run"], listed["status"], listed["finished_at"], listed["finished_step"]) == ("run-1", "finished", T0 + 7.0, 12)
        assert listed["last_step"] == 10  # the last report's step is still what it was
        detail = c.get("/v1/runs/run-1", headers=bearer(OP)).json()
        assert detail["finish_reason"] == "completed" and detail["firing"] == []
        events = c.get("/v1/runs/run-1/events", headers=bearer(OP)).json()
        finished = [e for e in events if e["kind"] == "finished"]
        assert len(finished) == 1 and finished[0]["data"] == {"step": 12, "reason": "completed"}
        assert finished[0]["time"] == T0 + 7.0 and finished[0]["actor"].startswith("agent:")
        metrics = c.get("/metrics", headers=bearer(OP)).text
        assert 'trainguard_controller_runs{status="finished"} 1.0' in metrics
        assert "/v1/runs/{run}/finish" in c.get("/openapi.json").json()["paths"]
        assert c.get("/v1/sd/targets", headers=bearer(OP)).json() == []  # no scrape of ranks that are gone


def test_finish_auth_and_bad_input(app_factory):
    with app_factory(**TOKENS) as c:
        register(c, headers=bearer(AG))
        register(c, run="run-b", headers=bearer(AG_BOUND))
        body = {"step": 3}
        assert c.post("/v1/runs/run-1/finish", json=body).status_code == 401
        assert c.post("/v1/runs/run-1/finish", json=body, headers=bearer("not-a-known-token")).status_code == 401
        r = c.post("/v1/runs/run-1/finish", json=body, headers=bearer(AG_BOUND))  # bound to run-b
        assert r.status_code == 403 and "run-b" in r.json()["detail"]
        assert c.post("/v1/runs/run-1/finish", json=body, headers=bearer(OP)).status_code == 403  # operators lack the agent scope
        r = c.post("/v1/runs/nope/finish", json=body, headers=bearer(AG))  # bound to run-1: as for run-b, which exists
        assert r.status_code == 403 and r.json()["detail"] == "this agent token is bound to run 'run-1', not 'nope'"
        for bad in ({"step": -1}, {"step": "x"}, {}, {"step": 1, "extra": True}, {"step": 1, "reason": "r" * 201}):
            r = c.post("/v1/runs/run-1/finish", json=bad, headers=bearer(AG))
            assert r.status_code == 422, (bad, r.text)
        r = c.post("/v1/runs/run-1/finish", content=b"{not json", headers=bearer(AG) | {"content-type": "application/json"})
        assert r.status_code == 422
        assert c.post("/v1/runs/run-1/finish", headers=bearer(AG)).status_code == 422  # no body
        assert c.get("/v1/runs/run-1", headers=bearer(OP)).json()["status"] == "registered"  # nothing above changed it
        assert c.post("/v1/runs/run-b/finish", json=body, headers=bearer(AG_BOUND)).json()["status"] == "finished"


# -- the ticker ---------------------------------------------------------------------------------
def test_finished_run_is_not_silent_and_its_absence_alert_resolves(app_factory, receiver_factory):
    rx = receiver_factory([200])
    now = [T0]
    with app_factory(clock=lambda: now[0], tick_s=0.02) as c:
        c.post("/v1/webhooks", json={"url": rx.url, "min_severity": "warning", "send_resolved": True})
        for run in ("done", "hung", "late"):
            register(c, run=run)
            assert c.post(f"/v1/runs/{run}/reports", json=report(5)).status_code == 200
        assert c.post("/v1/runs/done/finish", json={"step": 5}).json()["changed"] is True
        now[0] += 301.0
        wait_until(lambda: status(c, "hung")["status"] == "silent")  # negative control: a live silent run fires
        # the same tick evaluated "done" (runs are evaluated in order, then committed)
        assert status(c, "done")["status"] == "finished" and status(c, "done")["firing"] == []
        wait_until(lambda: status(c, "late")["status"] == "silent")
        assert {a["run"] for a in c.get("/v1/alerts").json()} == {"hung", "late"}
        # a run that finishes while its absence alert fires: the alert resolves, the page too
        late = c.post("/v1/runs/late/finish", json={"step": 5, "reason": "completed"}).json()
        assert late["status"] == "finished" and status(c, "late")["firing"] == []
        (resolved,) = c.get("/v1/alerts", params={"state": "resolved"}).json()
        assert (resolved["run"], resolved["rule"], resolved["ends_at"]) == ("late", "run_silent", T0 + 301.0)
        kinds = [(e["kind"], e["reason"]) for e in c.get("/v1/runs/late/events").json()]
        assert kinds[-2:] == [("finished", "finished at step 5: completed"), ("resolved", "run finished")]
        messages = wait_until(lambda: len(rx.requests) >= 3 and [json.loads(b) for _, b in rx.requests])
        by_status = sorted((m["alerts"][0]["labels"]["run"], m["status"]) for m in messages)
        assert by_status == [("hung", "firing"), ("late", "firing"), ("late", "resolved")]


@pytest.mark.parametrize("hold", ["pause", "stop"])
def test_no_absence_alert_right_after_a_long_pause_ends(app_factory, hold):
    now = [T0]
    with app_factory(clock=lambda: now[0], tick_s=0.02) as c:
        register(c, run="held")
        assert c.post("/v1/runs/held/reports", json=report(1)).status_code == 200
        assert c.post(f"/v1/runs/held/{hold}", json={"reason": "maintenance"}).json()["changed"] is True
        now[0] = T0 + 3_500.0
        register(c, run="control")  # live since T0 + 3500, never reports
        now[0] = T0 + 3_600.0  # an hour of pause: the last report is far older than the limit
        assert c.post("/v1/runs/held/resume", json={"reason": "back"}).json()["changed"] is True
        now[0] = T0 + 3_810.0  # 210 s after the resume, 3810 s after the last report
        wait_until(lambda: status(c, "control")["status"] == "silent")  # 310 s: the ticker ran at this time
        held = status(c, "held")
        assert held["status"] == "running" and held["firing"] == [] and held["live_since"] == T0 + 3_600.0
        now[0] = T0 + 3_901.0  # 301 s after the resume with no report: genuinely silent
        wait_until(lambda: status(c, "held")["status"] == "silent")
        (alert,) = status(c, "held")["firing_alerts"]
        assert alert["values"]["silent_s"] == pytest.approx(301.0)
        assert alert["values"]["silent_since"] == T0 + 3_600.0 and alert["values"]["last_report_at"] == T0


def _evaluations(c) -> float:  # type: ignore[no-untyped-def]
    return rule_evaluations(c.get("/metrics").text)


def test_the_time_a_controller_was_down_is_not_a_run_s_silence(app_factory):
    now = [T0]
    with app_factory(clock=lambda: now[0], tick_s=0.02) as c:
        register(c, run="quiet")  # silent before the controller goes down: its alert fires
        now[0] = T0 + 301.0
        wait_until(lambda: status(c, "quiet")["status"] == "silent")
        register(c, run="live")
        assert c.post("/v1/runs/live/reports", json=report(1)).status_code == 200
    now[0] = T0 + 1_000.0  # down for 699 s, more than the limit: "live" could not report meanwhile
    with app_factory(clock=lambda: now[0], tick_s=0.02) as c:
        ticks = _evaluations(c)
        wait_until(lambda: _evaluations(c) >= ticks + 4)  # the ticker checked both runs at least twice
        assert status(c, "live")["status"] == "running" and status(c, "live")["firing"] == []
        assert status(c, "quiet")["status"] == "silent"  # silent before the restart: still firing, not resolved
        assert [e["kind"] for e in c.get("/v1/runs/quiet/events").json()] == ["registered", "alert"]
        now[0] = T0 + 1_300.0  # 300 s after the restart without a report: genuinely silent
        wait_until(lambda: status(c, "live")["status"] == "silent")
        (alert,) = status(c, "live")["firing_alerts"]
        assert alert["values"]["silent_since"] == T0 + 1_000.0 and alert["values"]["last_report_at"] == T0 + 301.0


def _loss_report(step: int) -> dict:
    """A healthy run's report: the loss falls from 10 towards 1 along the steps (as it would again
    after a resume from an earlier step's checkpoint), the gradient norm steady."""
    loss = 1.0 + 9.0 * 0.9 ** step
    return {"job": "job-a", "step_first": step, "step_last": step, "time": float(step),
            "values": {"trainguard_loss": loss, "trainguard_grad_norm_max": 1.0 + 0.01 * (step % 3)}}


def test_a_job_restarted_from_an_earlier_checkpoint_is_judged_on_its_new_course(app_factory):
    with app_factory() as c:
        register(c, run="resumed")
        for step in range(1, 61):
            assert c.post("/v1/runs/resumed/reports", json=_loss_report(step)).json()["alerts"] == []
        register(c, run="resumed")  # the job died at step 60 and restarts from its checkpoint of step 5
        alerts = [c.post("/v1/runs/resumed/reports", json=_loss_report(step)).json()["alerts"] for step in range(6, 30)]
        assert alerts == [[]] * 24  # the loss of step 6 is not a spike over the steps 45-60 it left
        window = c.app.state.controller.runs["resumed"].window
        live = (window.count, window.series("trainguard_loss", 128).tolist())
        assert live == (84, [_loss_report(step)["values"]["trainguard_loss"] for step in range(6, 30)])
        events = c.get("/v1/runs/resumed/events").json()
        assert [e["kind"] for e in events] == ["registered", "registered"] and status(c, "resumed")["firing"] == []
    with app_factory() as c:  # a restarted controller reads the same window back
        window = c.app.state.controller.runs["resumed"].window
        assert (window.count, window.series("trainguard_loss", 128).tolist()) == live
        assert c.post("/v1/runs/resumed/reports", json=_loss_report(30)).json()["alerts"] == []


# -- persistence --------------------------------------------------------------------------------
def test_finished_and_resume_time_survive_a_restart_and_re_registration_makes_the_run_live(app_factory):
    now = [T0]
    with app_factory(clock=lambda: now[0]) as c:
        register(c, run="a")
        register(c, run="b")
        c.post("/v1/runs/a/lr-scale", json={"scale": 0.25, "reason": "keep me"})
        c.post("/v1/runs/b/pause", json={})
        now[0] += 100.0
        c.post("/v1/runs/b/resume", json={})
        now[0] += 10.0
        assert c.post("/v1/runs/a/finish", json={"step": 42, "reason": "stopped"}).status_code == 200
        before = status(c, "a")
        events_before = c.get("/v1/runs/a/events").json()
    now[0] += 1_000.0
    with app_factory(clock=lambda: now[0]) as c:
        after = status(c, "a")
        for key in ("status", "finished_at", "finished_step", "finish_reason", "desired", "live_since"):
            assert after[key] == before[key], key
        assert after["status"] == "finished" and after["finished_step"] == 42 and after["finished_at"] == T0 + 110.0
        assert status(c, "b")["live_since"] == T0 + 100.0  # the resume time, not the registration's
        assert c.post("/v1/runs/a/finish", json={"step": 50}).json()["changed"] is False
        # the job restarts: live again, desired state and history kept
        reg = register(c, run="a")
        assert reg["desired"]["lr_scale"] == 0.25
        live = status(c, "a")
        assert live["status"] == "registered" and live["finished_at"] is None and live["finished_step"] is None
        assert live["live_since"] == T0 + 1_110.0
        events = c.get("/v1/runs/a/events").json()
        assert events[: len(events_before)] == events_before and events[-1]["reason"] == "re-registered"
    with app_factory(clock=lambda: now[0]) as c:
        assert status(c, "a")["status"] == "registered" and status(c, "a")["finished_at"] is None
