"""A run's incidents survive a controller restart: read back from their audit events, the open
one resumes its escalation ladder, and new incidents are numbered after the old ones."""

from __future__ import annotations

from tests.service.conftest import LADDER_STEPS, climb_ladder, register


def test_incidents_are_read_back_after_a_restart_and_the_open_one_climbs_on(app_factory) -> None:
    with app_factory() as c:
        register(c, "run-1")
        climb_ladder(c, "run-1", until=LADDER_STEPS["rollback"])  # opened, adaptive LR, rolled back: still open
        before = c.get("/v1/runs/run-1/incidents").json()["incidents"]
    (incident,) = before
    assert incident["outcome"] == "open"
    assert [r["rung"] for r in incident["rungs"]] == ["adaptive_lr", "rollback"]

    with app_factory() as c:  # a new controller on the same database
        assert c.get("/v1/runs/run-1/incidents").json()["incidents"] == before
        # the signals stay bad: the restored incident takes its next rung after a full window
        climb_ladder(c, "run-1", after=LADDER_STEPS["rollback"])
        (after,) = c.get("/v1/runs/run-1/incidents").json()["incidents"]
        assert after["id"] == incident["id"] and after["outcome"] == "escalated"
        assert after["rungs"][:2] == incident["rungs"]
        assert [r["rung"] for r in after["rungs"]] == ["adaptive_lr", "rollback", "pause"]
        assert after["rungs"][2]["step"] == LADDER_STEPS["pause"]
        assert c.get("/v1/runs/run-1/desired").json()["paused"] is True
        # a new run's first incident is numbered after the ones recorded before the restart
        register(c, "run-2")
        climb_ladder(c, "run-2", until=LADDER_STEPS["adaptive_lr"])
        (second,) = c.get("/v1/runs/run-2/incidents").json()["incidents"]
        assert second["id"] > incident["id"]

    with app_factory() as c:  # and again: the closed incident reads back closed, nothing is open
        assert c.get("/v1/runs/run-1/incidents").json()["incidents"] == [after]
        assert c.get("/v1/runs/run-2/incidents").json()["incidents"] == [second]
