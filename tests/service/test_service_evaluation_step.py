"""The live controller and the replay take the same evaluate → decide → record step
(``service/evaluation_step.py``): a recorded report sequence that opens an incident and climbs its
ladder gives the same alerts, desired states and incident rungs through ``POST /v1/runs/{run}/reports``
(TestClient, the real store) and through ``engine.simulate``."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from tests.service.conftest import LADDER_STEPS, LADDER_STRIDE, climb_ladder, register
from trainguard.service.engine import simulate
from trainguard.service.rules import default_rules_text, load_rules
from trainguard.protocol.wire import Report

RULES = load_rules(default_rules_text())


class _Recording:
    """A client that sets the controller's clock to each report's time and keeps what it sent."""

    def __init__(self, client: Any, now: list[float]) -> None:
        self.client, self.now = client, now
        self.sent: list[dict[str, Any]] = []
        self.answers: list[dict[str, Any]] = []

    def post(self, url: str, json: dict[str, Any], headers: dict[str, str]) -> Any:
        self.now[0] = json["time"]
        resp = self.client.post(url, json=json, headers=headers)
        self.sent.append(json)
        self.answers.append(resp.json())
        return resp


def _healthy(recording: _Recording, after: int, reports: int) -> None:
    """Reports with the gradient norm back under its limit (the rule's alert resolves)."""
    for k in range(1, reports + 1):
        step = after + k * LADDER_STRIDE
        body = {"job": "job-a", "step_first": step, "step_last": step, "time": float(step),
                "values": {"trainguard_grad_norm_max": 1.0, "trainguard_snapshot_step": float(2 * LADDER_STRIDE)}}
        assert recording.post("/v1/runs/run-1/reports", json=body, headers={}).status_code == 200


def test_a_report_sequence_fires_resolves_and_climbs_alike_live_and_replayed(app_factory: Any) -> None:
    now = [0.0]
    with app_factory(clock=lambda: now[0]) as client:
        register(client, world_size=1)
        recording = _Recording(client, now)
        climb_ladder(recording)
        _healthy(recording, LADDER_STEPS["pause"], 3)
        events = client.get("/v1/runs/run-1/events", params={"limit": 5000}).json()
        incidents = client.get("/v1/runs/run-1/incidents").json()["incidents"]
    steps = simulate(RULES.for_job("job-a"), [Report.model_validate(b) for b in recording.sent], world_size=1,
                     policy=RULES.file.recovery)
    assert len(steps) == len(recording.sent)

    replayed: dict[int, dict[str, Any]] = {}
    for s in steps:
        replayed.update({inc["id"]: inc for inc in s.incidents})
    assert len(incidents) == len(replayed) == 1
    # (incident ids come from one counter per process: the replay's is another number)
    (sim_id, incident), live_id = replayed.popitem(), incidents[0]["id"]

    def same_id(desired: Any) -> dict[str, Any]:
        d = desired.model_dump()
        return d | {"reason": d["reason"].replace(f"incident {sim_id} ", f"incident {live_id} ")}

    by_time: dict[float, dict[str, list[Any]]] = defaultdict(lambda: defaultdict(list))
    for ev in events:
        by_time[ev["time"]][ev["kind"]].append(ev)
    for sent, answer, step in zip(recording.sent, recording.answers, steps):
        live = by_time[sent["time"]]
        assert [f.finding.rule.name for f in step.fired] == answer["alerts"] == [e["actor"][5:] for e in live["alert"]]
        assert step.resolved == [e["actor"][5:] for e in live["resolved"]]
        assert same_id(step.desired) == answer["desired"]
        changed = [same_id(fa.desired) for fa in step.fired if fa.desired is not None] + [same_id(d) for d in step.recovery]
        assert [(d["generation"], d["reason"]) for d in changed] == [(e["generation"], e["reason"]) for e in live["desired"]]

    # the sequence did what it is for: an alert, its resolution, and the incident up the ladder
    assert any(s.fired for s in steps) and any(s.resolved for s in steps)
    assert steps[-1].desired.paused and steps[-1].desired.rollback_step == 2 * LADDER_STRIDE
    rungs = [(r["rung"], r["step"]) for r in incidents[0]["rungs"]]
    assert rungs == sorted(LADDER_STEPS.items(), key=lambda kv: kv[1])
    assert [(r["rung"], r["step"]) for r in incident["rungs"]] == rungs
    assert incident["outcome"] == incidents[0]["outcome"] and incident["cause"] == incidents[0]["cause"]
