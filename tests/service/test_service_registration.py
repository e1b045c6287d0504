"""Registering a run (service/registration.py): two ranks that register one /metrics endpoint
(host:port) are accepted (the run is monitored and controlled all the same) and warned of in the
registration event, naming the ranks; ranks with endpoints of their own, or none, are not. Registering
it again (its job restarted): what the answer says the run's processes applied, and what the
controller forgets of the process that ended."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from trainguard.protocol.wire import DesiredState, dumps
from tests.service.conftest import LADDER_STEPS, LADDER_STRIDE, climb_ladder, register


def _ranks(*endpoints: tuple[int, str, int]) -> list[dict[str, Any]]:
    return [{"rank": r, "local_rank": 0, "host": host, "port": port} for r, host, port in endpoints]


def _registered_reason(client: Any, ranks: list[dict[str, Any]], world_size: int = 16) -> str:
    resp = client.post("/v1/runs", json={"job": "job-a", "run": "run-1", "world_size": world_size, "ranks": ranks})
    assert resp.status_code == 200, resp.text
    events = client.get("/v1/runs/run-1/events").json()
    return [e["reason"] for e in events if e["kind"] == "registered"][-1]


def test_ranks_sharing_a_metrics_endpoint_are_accepted_and_named(app_factory, caplog: pytest.LogCaptureFixture) -> None:
    # ranks 0 and 8: local rank 0 of two nodes with the loopback metrics_host; ranks 3 and 5: one port, two names of a host
    ranks = _ranks((0, "127.0.0.1", 9400), (8, "127.0.0.1", 9400), (1, "node-a", 9401), (3, "node-b", 9402),
                   (5, "NODE-B", 9402), (9, "node-b", 9403))
    with app_factory() as client, caplog.at_level(logging.WARNING, logger="trainguard.controller"):
        reason = _registered_reason(client, ranks)
        assert client.get("/v1/runs/run-1").status_code == 200  # registered: monitored and controlled
    expected = ("registered; one /metrics endpoint registered by several ranks: 127.0.0.1:9400 by ranks 0, 8; "
                "node-b:9402 by ranks 3, 5; Prometheus scrapes one process there, not each rank: give every rank a "
                "host other hosts reach (AgentConfig.metrics_host) and a port of its own")
    assert reason == expected
    assert [r.getMessage() for r in caplog.records] == [f"run 'run-1': {expected[len('registered; '):]}"]


def test_many_shared_endpoints_are_named_up_to_a_bound(app_factory) -> None:
    ranks = _ranks(*((r, "127.0.0.1", 9400 + r % 6) for r in range(60)))  # 6 ports, 10 ranks on each
    with app_factory() as client:
        reason = _registered_reason(client, ranks, world_size=60)
    assert "127.0.0.1:9400 by ranks 0, 6, 12, 18 and 6 more; " in reason
    assert "127.0.0.1:9403 by ranks 3, 9, 15, 21 and 6 more (and 2 more endpoints);" in reason
    assert "9404" not in reason


@pytest.mark.parametrize("ranks", [
    _ranks((0, "127.0.0.1", 9400), (1, "127.0.0.1", 9401), (2, "node-b", 9400)),  # endpoints of their own
    _ranks((0, "node-a", 9400)),  # ranks 1-3 without a metrics port (metrics_port=None) are not listed
    [],
])
def test_ranks_with_endpoints_of_their_own_or_none_are_not_warned(app_factory, ranks: list[dict[str, Any]]) -> None:
    with app_factory() as client:
        assert _registered_reason(client, ranks, world_size=4) == "registered"
        register(client, world_size=4)  # a restart of the run: its ranks' ports of their own
        events = client.get("/v1/runs/run-1/events").json()
    assert [e["reason"] for e in events if e["kind"] == "registered"] == ["registered", "re-registered"]


def _report(c: Any, step: int, values: dict[str, float] | None = None, **extra: Any) -> dict[str, Any]:
    body = {"job": "job-a", "step_first": step, "step_last": step, "time": float(step), "values": values or {}, **extra}
    resp = c.post("/v1/runs/run-1/reports", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_a_registration_again_answers_the_state_the_runs_processes_applied(app_factory) -> None:
    with app_factory() as c:
        assert register(c)["applied"] is None  # a new run: nothing applied by anyone
        first = c.post("/v1/runs/run-1/checkpoint", json={"reason": "a"}).json()["desired"]
        assert c.post("/v1/runs/run-1/acks", json={"generation": first["generation"], "step": 5}).status_code == 200
        second = c.post("/v1/runs/run-1/checkpoint", json={"reason": "b"}).json()["desired"]
        again = register(c)
        assert again["desired"]["checkpoint_seq"] == second["checkpoint_seq"] == 2
        assert again["applied"] == first  # the second checkpoint: taken by no process
        # a report's applied generation counts as well (its ack may have been lost)
        _report(c, 6, applied_generation=second["generation"])
        assert register(c)["applied"] == second
    with app_factory() as c:  # and after a controller restart, from its database
        assert register(c)["applied"] == second
        register(c, "run-2")
        assert register(c, "run-2")["applied"] == json.loads(dumps(DesiredState()))  # never applied: the initial state


def test_a_registration_again_forgets_the_snapshots_of_the_process_that_ended(app_factory) -> None:
    with app_factory() as c:
        register(c)
        climb_ladder(c, until=LADDER_STEPS["adaptive_lr"])  # a good snapshot, then an incident opens
        assert [s["good"] for s in c.get("/v1/runs/run-1/incidents").json()["snapshots"]] == [True]
        (opened,) = c.get("/v1/runs/run-1/incidents").json()["incidents"]
        register(c)  # the job restarted: its snapshots were in the memory of the process that ended
        recorded = c.get("/v1/runs/run-1/incidents").json()
        assert recorded["snapshots"] == [] and recorded["incidents"] == [opened]  # the incident carried on
        refused = c.post("/v1/runs/run-1/rollback", json={"reason": "by hand"})
        assert refused.status_code == 409 and "no snapshot" in refused.text
        # the signals stay bad on the new process: the ladder never rolls back to a snapshot it lacks
        for step in range(LADDER_STEPS["adaptive_lr"] + LADDER_STRIDE, LADDER_STEPS["pause"] + 1, LADDER_STRIDE):
            _report(c, step, {"trainguard_grad_norm_max": 3000.0})
        (after,) = c.get("/v1/runs/run-1/incidents").json()["incidents"]
        assert after["id"] == opened["id"] and "rollback refused: the run reports no snapshot" in after["rungs"][-1]["reason"]
        assert c.get("/v1/runs/run-1/desired").json()["rollback_seq"] == 0  # (paused for a human instead)
        c.post("/v1/runs/run-1/resume", json={"reason": "by hand"})
        # the new process's own snapshot, once confirmed, is a rollback's target again
        for step in range(LADDER_STEPS["pause"] + LADDER_STRIDE, LADDER_STEPS["pause"] + 12 * LADDER_STRIDE, LADDER_STRIDE):
            _report(c, step, {"trainguard_snapshot_step": float(LADDER_STEPS["pause"] + LADDER_STRIDE),
                              "trainguard_grad_norm_max": 1.0})
        assert c.post("/v1/runs/run-1/rollback", json={"reason": "by hand"}).json()["desired"]["rollback_step"] == \
            LADDER_STEPS["pause"] + LADDER_STRIDE


# -- the node each rank runs on (RankEndpoint.node) ----------------------------------------------
def _straggling(client: Any, run: str = "run-1") -> dict[str, Any]:
    """Five reports, one every 10 steps, in which rank 1 of 2 takes 2.5x rank 0's forward: the
    straggler alert."""
    for step in (10, 20, 30, 40, 50):
        body = {"job": "job-a", "step_first": step, "step_last": step, "time": float(step), "values": {},
                "ranks": {"forward_s": [0.02, 0.05]}}
        assert client.post(f"/v1/runs/{run}/reports", json=body).status_code == 200
    (alert,) = [a for a in client.get("/v1/alerts", params={"run": run}).json() if a["rule"] == "forward_time_straggler"]
    return alert


def test_each_rank_s_node_is_kept_shown_and_named_beside_its_rank_in_an_alert(app_factory) -> None:
    ranks = [{"rank": r, "local_rank": 0, "host": "127.0.0.1", "port": 9400, "node": f"gpu-{'ab'[r]}.dc1"} for r in (0, 1)]
    with app_factory() as client:
        assert client.post("/v1/runs", json={"job": "job-a", "run": "run-1", "world_size": 2, "ranks": ranks}).status_code == 200
        assert client.get("/v1/runs/run-1").json()["ranks"] == ranks
        alert = _straggling(client)
        assert alert["summary"].endswith("(in the newest report 0.05 against 0.02) (limit 1.5x) (rank 1 on node gpu-b.dc1)")
        assert alert["values"]["nodes"] == {"1": "gpu-b.dc1"} and alert["values"]["ranks"] == [1]
    with app_factory() as client:  # read back after a restart
        assert client.get("/v1/runs/run-1").json()["ranks"] == ranks


def test_an_agent_that_sends_no_node_registers_as_before(app_factory) -> None:
    ranks = _ranks((0, "127.0.0.1", 9400), (1, "127.0.0.1", 9401))
    with app_factory() as client:
        assert client.post("/v1/runs", json={"job": "job-a", "run": "run-1", "world_size": 2, "ranks": ranks}).status_code == 200
        assert client.get("/v1/runs/run-1").json()["ranks"] == ranks  # no "node" key: what it sent
        alert = _straggling(client)
        assert alert["summary"].endswith("(limit 1.5x)") and "nodes" not in alert["values"]
        ranks[0]["node"] = None  # an explicit null is no node
        assert client.post("/v1/runs", json={"job": "job-a", "run": "run-2", "world_size": 2, "ranks": ranks}).status_code == 200
        assert "node" not in client.get("/v1/runs/run-2").json()["ranks"][0]


@pytest.mark.parametrize("node", ["g" * 254, "gpu a", "gpu-7\n", "-gpu", "gpü", "", "gpu/7", 7])
def test_a_node_name_past_its_bounds_is_refused_naming_the_field(app_factory, node: Any) -> None:
    ranks = [{"rank": 0, "local_rank": 0, "host": "127.0.0.1", "port": 9400, "node": node}]
    with app_factory() as client:
        resp = client.post("/v1/runs", json={"job": "job-a", "run": "run-1", "world_size": 1, "ranks": ranks})
        assert resp.status_code == 422 and "ranks.0.node" in resp.json()["detail"], resp.text
        assert client.get("/v1/runs/run-1").status_code == 404
        ranks[0]["node"] = "g" * 253
        assert client.post("/v1/runs", json={"job": "job-a", "run": "run-1", "world_size": 1, "ranks": ranks}).status_code == 200
