"""The controller's own metrics of incidents (``service/metrics.py``), read from ``GET /metrics``
while a run's incident climbs the ladder and another's recovers."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from trainguard.service.metrics import BY_NAME, INCIDENT_OUTCOMES
from trainguard.protocol.commands import REGISTRY
from trainguard.service.rules import REMEDY_RUNGS, RecoveryPolicy
from tests.service.conftest import LADDER_STEPS, climb_ladder, register


def _samples(c) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    families = text_string_to_metric_families(c.get("/metrics").text)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples
            if "incident" in s.name and not s.name.endswith("_created")}


def _counts(c) -> tuple[dict[str, float], dict[str, float]]:
    samples = _samples(c)
    outcomes = {dict(labels)["outcome"]: v for (name, labels), v in samples.items() if name == "trainguard_controller_incidents_total"}
    rungs = {dict(labels)["rung"]: v for (name, labels), v in samples.items() if name == "trainguard_controller_incident_rungs_total"}
    return outcomes, rungs


#: Every rung at 0 (the counter exports each label from the start).
_NONE = dict.fromkeys(("skip", "adaptive_lr", "rollback", "pause", "data_skip", "checkpoint", "stop", "experiment",
                       "grad_clip", "reset_optimizer"), 0.0)


def _runs(c, gauge: str) -> dict[str, float]:
    return {dict(labels)["run"]: v for (name, labels), v in _samples(c).items() if name == gauge}


def test_incident_counters_start_at_zero_for_every_outcome_and_rung(app_factory):
    with app_factory() as c:
        outcomes, rungs = _counts(c)
        assert outcomes == dict.fromkeys(INCIDENT_OUTCOMES, 0.0)
        # every rung the rules may name: the optimizer's ladder and those of the other causes, and the
        # optimizer remedies a rules file may add to the optimizer's ladder
        policy = RecoveryPolicy()
        ladders = policy.ladders
        assert REMEDY_RUNGS == ("grad_clip", "reset_optimizer")
        assert rungs == dict.fromkeys({*policy.ladder, *ladders.data, *ladders.hardware, *ladders.unknown, "stop",
                                       *REMEDY_RUNGS}, 0.0)
        assert _runs(c, "trainguard_controller_incidents_open") == {}
        assert _runs(c, "trainguard_controller_incidents_awaiting_human") == {}
    assert {"outcome"} == set(BY_NAME["trainguard_controller_incidents_total"].labels)


def test_incidents_and_rungs_are_counted_and_the_gauges_follow_each_run(app_factory):
    with app_factory() as c:
        register(c, "run-1")
        register(c, "run-2")
        climb_ladder(c, "run-1", until=LADDER_STEPS["rollback"])  # open, rolled back, not yet paused
        assert _runs(c, "trainguard_controller_incidents_open") == {"run-1": 1.0}
        assert _counts(c) == ({"opened": 1.0, "recovered": 0.0, "escalated": 0.0},
                              dict(_NONE, adaptive_lr=1.0, rollback=1.0))

        climb_ladder(c, "run-1", after=LADDER_STEPS["rollback"])
        # run-2: an LR action (the norm rose across 1e3) opens an incident, five healthy reports close it
        for step, grad in enumerate([1.0, 3000.0] + [1.0] * 5, start=1):
            c.post("/v1/runs/run-2/reports", json={"job": "job-a", "step_first": step, "step_last": step, "time": 1.0,
                                                   "values": {"trainguard_grad_norm_max": grad}})
        incidents = {run: c.get(f"/v1/runs/{run}/incidents").json()["incidents"] for run in ("run-1", "run-2")}
        assert [i["outcome"] for i in incidents["run-1"]] == ["escalated"]
        assert [i["outcome"] for i in incidents["run-2"]] == ["recovered"]
        assert _counts(c) == ({"opened": 2.0, "recovered": 1.0, "escalated": 1.0},
                              dict(_NONE, adaptive_lr=2.0, rollback=1.0, pause=1.0))
        assert _runs(c, "trainguard_controller_incidents_open") == {}
        assert _runs(c, "trainguard_controller_incidents_awaiting_human") == {"run-1": 1.0}

        # an operator resumes run-1: nobody is waited for any more, nor after a pause of their own
        assert c.post("/v1/runs/run-1/resume", json={"reason": "fixed the schedule"}).status_code == 200
        assert _runs(c, "trainguard_controller_incidents_awaiting_human") == {}
        assert c.post("/v1/runs/run-1/pause", json={"reason": "a look at the data"}).status_code == 200
        assert _runs(c, "trainguard_controller_incidents_awaiting_human") == {}


def _actions(c) -> dict[tuple[str, str], float]:
    families = text_string_to_metric_families(c.get("/metrics").text)
    return {(s.labels["action"], s.labels["source"]): s.value for f in families for s in f.samples
            if s.name == "trainguard_controller_actions_total"}


def test_every_command_is_counted_from_zero_accumulation_included(app_factory):
    """The actions counter exports every command of the registry at 0 for each source that can
    give it, and counts each command by its name: accumulation too (it once had no case)."""
    with app_factory() as c:
        actions = _actions(c)
        for spec in REGISTRY:
            assert actions[(spec.name, "recovery")] == 0.0
            assert ((spec.name, "operator") in actions) == spec.operator
            assert ((spec.name, "alertmanager") in actions) == spec.alertmanager
            assert ((spec.name, "rule") in actions) == (spec.rule_action is not None)
        body = {"job": "job-a", "run": "run-1", "world_size": 1, "agent_version": "test",
                "ranks": [{"rank": 0, "local_rank": 0, "host": "127.0.0.1", "port": 9100}],
                "config": {"accumulation_steps": 2}}
        assert c.post("/v1/runs", json=body).status_code == 200
        assert c.post("/v1/runs/run-1/accumulation", json={"steps": 4}).status_code == 200
        assert c.post("/v1/runs/run-1/accumulation", json={"steps": 4}).json()["changed"] is False  # not counted
        assert c.post("/v1/runs/run-1/grad-clip", json={"max_norm": 1.0}).status_code == 200
        after = _actions(c)
        changed = {k: v for k, v in after.items() if v != actions[k]}
        assert changed == {("accumulation", "operator"): 1.0, ("grad_clip", "operator"): 1.0}
