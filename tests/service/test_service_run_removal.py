"""Removing runs (service/run_removal.py): an operator's ``DELETE /v1/runs/{run}`` and the prune's
removal of runs that ended longer ago than the report retention. A removed run leaves the
controller's limits, the run list and the database (its reports in batches), stays gone after a
restart, keeps its audit trail, and its name may be registered again as a new run."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from trainguard.service import absence_ticker
from trainguard.service.app import create_app
from trainguard.service.config import Settings
from tests.service.conftest import climb_ladder, register

T0 = 1_000_000.0
DAY = 86400.0
OP, READER = "operator-token-01", "reader-token-01"


def _h(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _report(c: TestClient, run: str, step: int, headers: dict[str, str] | None = None) -> None:
    body = {"job": "job-a", "step_first": step, "step_last": step, "time": float(step), "values": {"trainguard_loss": 1.0}}
    resp = c.post(f"/v1/runs/{run}/reports", json=body, headers=headers or {})
    assert resp.status_code == 200, resp.text


def _finish(c: TestClient, run: str, headers: dict[str, str] | None = None) -> None:
    resp = c.post(f"/v1/runs/{run}/finish", json={"step": 3, "reason": "done"}, headers=headers or {})
    assert resp.status_code == 200, resp.text


def _rows(c: TestClient, query: str) -> list[tuple[Any, ...]]:
    return c.app.state.controller.store.read_now(lambda conn: [tuple(r) for r in conn.execute(query)])


def _names(c: TestClient, headers: dict[str, str] | None = None) -> list[str]:
    return [r["run"] for r in c.get("/v1/runs", headers=headers or {}).json()]


def test_a_deleted_run_frees_the_controllers_limit_and_stays_gone_after_a_restart(store_db: Any) -> None:
    settings = Settings(db=store_db, max_runs=2, tick_s=60)
    with TestClient(create_app(settings)) as c:
        for run in ("a", "b"):
            register(c, run=run, world_size=1)
            _report(c, run, 1)
            _finish(c, run)
        full = c.post("/v1/runs", json={"job": "job-a", "run": "c", "world_size": 1})
        assert (full.status_code, full.json()["detail"]) == (429, "the controller holds 2 runs, its limit (TRAINGUARD_MAX_RUNS)")
        resp = c.delete("/v1/runs/a", params={"reason": "debugging run"})
        assert (resp.status_code, resp.json()) == (200, {"run": "a", "job": "job-a", "status": "finished", "deleted": True})
        assert c.delete("/v1/runs/a").status_code == 404
        assert c.get("/v1/runs/a").status_code == 404
        register(c, run="c", world_size=1)
        assert _names(c) == ["b", "c"]
        assert _rows(c, "SELECT run FROM runs ORDER BY id") == [("b",), ("c",)]
    with TestClient(create_app(settings)) as c:  # restarted: a stays gone, b and c fill the limit
        assert _names(c) == ["b", "c"]
        assert c.post("/v1/runs", json={"job": "job-a", "run": "d", "world_size": 1}).status_code == 429
        assert c.delete("/v1/runs/b").status_code == 200
        register(c, run="d", world_size=1)
        assert _names(c) == ["c", "d"]


def test_a_deleted_name_is_registered_again_as_a_new_run_with_its_own_history(store_db: Any) -> None:
    with TestClient(create_app(Settings(db=store_db, tick_s=60))) as c:
        register(c, run="a", world_size=1)
        register(c, run="b", world_size=1)
        _report(c, "b", 1)
        _finish(c, "b")
        old_id = c.app.state.controller.runs["b"].id
        assert c.delete("/v1/runs/b").status_code == 200  # the highest id: SQLite would hand it out again
        register(c, run="b", world_size=1)
        new = c.app.state.controller.runs["b"]
        assert new.id > old_id and c.get("/v1/runs/b").json()["reports"] == 0
        assert c.get("/v1/runs/b").json()["status"] == "registered"
        kinds = [(e["run"], e["kind"]) for e in c.get("/v1/runs/b/events").json()]
        # the audit trail of the name: the deleted run's events, its deletion, the new run's registration
        assert kinds == [("b", "registered"), ("b", "finished"), ("b", "deleted"), ("b", "registered")]
        assert _rows(c, f"SELECT COUNT(*) FROM events WHERE run_id = {new.id}") == [(1,)]


def test_a_live_run_is_refused_unless_forced(store_db: Any) -> None:
    with TestClient(create_app(Settings(db=store_db, tick_s=60))) as c:
        register(c, run="a", world_size=1)
        _report(c, "a", 1)
        resp = c.delete("/v1/runs/a")
        assert resp.status_code == 409
        assert resp.json()["detail"].startswith("run 'a' is live: its last report or registration was")
        assert "force=true" in resp.json()["detail"] and _names(c) == ["a"]
        assert c.post("/v1/runs/a/pause", json={"reason": "look"}).status_code == 200
        assert "it is paused" in c.delete("/v1/runs/a").json()["detail"]
        resp = c.delete("/v1/runs/a", params={"force": "true", "reason": "abandoned"})
        assert resp.status_code == 200 and resp.json()["status"] == "paused"
        deleted = c.get("/v1/runs/a/events").json()[-1]
        assert (deleted["kind"], deleted["reason"], deleted["data"]) == ("deleted", "abandoned", {"status": "paused", "forced": True})
        assert _names(c) == []


def test_a_stopped_or_long_silent_run_is_deleted_without_force(tmp_path: Any) -> None:
    now = [T0]
    with TestClient(create_app(Settings(db=tmp_path / "tg.db", tick_s=60), clock=lambda: now[0])) as c:
        register(c, run="stopped", world_size=1)
        register(c, run="silent", world_size=1)
        assert c.post("/v1/runs/stopped/stop", json={"reason": "bad"}).status_code == 200
        assert c.delete("/v1/runs/stopped").status_code == 200
        now[0] = T0 + 300  # the absence rule's silence: still live
        assert c.delete("/v1/runs/silent").status_code == 409
        now[0] = T0 + 301
        assert c.delete("/v1/runs/silent").status_code == 200


def test_only_an_operator_with_the_command_scope_deletes(tmp_path: Any) -> None:
    settings = Settings(db=tmp_path / "tg.db", operator_tokens=(OP, f"{READER}:read"), agent_tokens=("agent-token-01", "agent-token-02"))
    with TestClient(create_app(settings)) as c:
        agent = _h("agent-token-01")
        register(c, run="a", world_size=1, headers=agent)
        _finish(c, "a", headers=agent)
        resp = c.delete("/v1/runs/a", headers=_h(READER))
        assert resp.status_code == 403 and "command" in resp.json()["detail"]
        assert c.delete("/v1/runs/a", headers=agent).status_code == 403  # not even its own run
        assert c.delete("/v1/runs/a").status_code == 401
        assert _names(c, _h(OP)) == ["a"]
        assert c.delete("/v1/runs/a", headers=_h(OP)).json()["deleted"] is True
        assert c.get("/v1/runs/a/events", headers=_h(OP)).json()[-1]["actor"] == f"operator:{_digest(OP)}"
        register(c, run="a", world_size=1, headers=agent)  # the token bound to it registers it again
        resp = c.post("/v1/runs", json={"job": "job-a", "run": "a", "world_size": 1}, headers=_h("agent-token-02"))
        assert resp.status_code == 403 and "belongs to another agent token" in resp.json()["detail"]


def _digest(token: str) -> str:
    import hashlib

    return hashlib.sha256(token.encode()).hexdigest()[:12]


def test_a_runtime_tokens_deleted_runs_leave_its_limit_and_free_the_name(store_db: Any) -> None:
    settings = Settings(db=store_db, operator_tokens=(OP,), max_runs_per_token=2, tick_s=60)
    with TestClient(create_app(settings)) as c:
        ci, other = ({"Authorization": "Bearer " + c.post("/v1/tokens", json={"scopes": ["agent"], "job": "job-*"},
                                                           headers=_h(OP)).json()["token"]} for _ in range(2))
        for run in ("ci-1", "ci-2"):
            register(c, run=run, world_size=1, headers=ci)
            _finish(c, run, headers=ci)
        resp = c.post("/v1/runs", json={"job": "job-a", "run": "ci-3", "world_size": 1}, headers=ci)
        assert resp.status_code == 429 and "this token registered 2 runs" in resp.json()["detail"]
        assert c.delete("/v1/runs/ci-1", headers=_h(OP)).status_code == 200
        register(c, run="ci-3", world_size=1, headers=ci)
        register(c, run="ci-1", world_size=1, headers=other)  # the name is free, for another token too
        # ci no longer owns ci-1: answered as for a run nobody registered
        assert c.post("/v1/runs/ci-1/finish", json={"step": 1}, headers=ci).status_code == 404
    with TestClient(create_app(settings)) as c:  # the counts after a restart: ci holds ci-2 and ci-3
        assert c.post("/v1/runs", json={"job": "job-a", "run": "ci-4", "world_size": 1}, headers=ci).status_code == 429
        assert c.post("/v1/runs", json={"job": "job-a", "run": "ci-5", "world_size": 1}, headers=other).status_code == 200


def test_a_deleted_runs_firing_alert_resolves_and_its_reports_are_deleted_in_batches(store_db: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr(absence_ticker, "PRUNE_REPORTS", 3)
    monkeypatch.setattr(absence_ticker, "PRUNE_BATCHES", 2)
    now = [T0]
    with TestClient(create_app(Settings(db=store_db, tick_s=60), clock=lambda: now[0])) as c:
        ctl = c.app.state.controller
        register(c, run="a", world_size=1)
        register(c, run="kept", world_size=1)
        for step in range(7):
            _report(c, "a", step)
            _report(c, "kept", step)
        c.portal.call(ctl.tick)  # the hourly prune of this start (nothing is old)
        now[0] = T0 + 400
        c.portal.call(ctl.tick)
        assert c.get("/v1/runs/a").json()["status"] == "silent"
        assert c.delete("/v1/runs/a").status_code == 200
        alerts = c.get("/v1/alerts", params={"run": "a"}).json()
        assert [(a["run"], a["rule"], a["state"]) for a in alerts] == [("a", "run_silent", "resolved")]
        a_id, kept_id = (r[0] for r in _rows(c, "SELECT run_id FROM deleted_runs UNION ALL SELECT id FROM runs"))
        left = [_rows(c, f"SELECT COUNT(*) FROM reports WHERE run_id = {a_id}")[0][0]]
        for _ in range(2):
            c.portal.call(ctl.tick)  # two transactions of three a tick (not yet an hour: no other prune)
            left.append(_rows(c, f"SELECT COUNT(*) FROM reports WHERE run_id = {a_id}")[0][0])
        assert left == [7, 1, 0]
        assert _rows(c, f"SELECT COUNT(*) FROM reports WHERE run_id = {kept_id}") == [(7,)]
        assert _rows(c, "SELECT reports_left FROM deleted_runs") == [(0,)]


def test_the_prune_removes_runs_ended_longer_ago_than_the_retention_and_never_a_paused_one(store_db: Any) -> None:
    now = [T0]
    settings = Settings(db=store_db, tick_s=60, report_retention_s=2 * DAY)
    with TestClient(create_app(settings, clock=lambda: now[0])) as c:
        ctl = c.app.state.controller
        for run in ("finished", "silent", "paused", "healthy"):
            register(c, run=run, world_size=1)
            _report(c, run, 1)
        _finish(c, "finished")
        assert c.post("/v1/runs/paused/pause", json={"reason": "waits for a person"}).status_code == 200
        c.portal.call(ctl.tick)  # the first prune
        for hour in range(1, 2 * 24 + 2):
            now[0] = T0 + hour * 3601  # (an hourly prune at each)
            _report(c, "healthy", hour + 1)
            c.portal.call(ctl.tick)
            if hour == 2 * 24:  # over 48 h since the finished run's finish and the silent run's report
                assert _names(c) == ["paused", "healthy"], hour
            elif hour < 2 * 24:
                assert _names(c) == ["finished", "silent", "paused", "healthy"], hour
        events = c.get("/v1/runs/finished/events").json()
        assert (events[-1]["kind"], events[-1]["actor"]) == ("deleted", "controller")
        assert events[-1]["reason"] == "finished 2.0 days ago (TRAINGUARD_REPORT_RETENTION_S)"
    with TestClient(create_app(settings, clock=lambda: now[0])) as c:
        assert _names(c) == ["paused", "healthy"]


def test_silence_before_the_controllers_start_does_not_remove_a_run(tmp_path: Any) -> None:
    now = [T0]
    settings = Settings(db=tmp_path / "tg.db", tick_s=60, report_retention_s=2 * DAY)
    with TestClient(create_app(settings, clock=lambda: now[0])) as c:
        register(c, run="a", world_size=1)
    now[0] = T0 + 3 * DAY  # the controller was down for three days
    with TestClient(create_app(settings, clock=lambda: now[0])) as c:
        ctl = c.app.state.controller
        assert ctl.ticker.watching_since == now[0]
        c.portal.call(ctl.tick)  # the first prune: silent for three days, but not since the start
        assert _names(c) == ["a"]
        now[0] += 2 * DAY + 1
        c.portal.call(ctl.tick)
        assert _names(c) == []


@pytest.mark.parametrize("params, field", [({"force": "maybe"}, "force"), ({"force": "2"}, "force"),
                                           ({"reason": "x\x1b[2J"}, "reason"), ({"reason": "x" * 2001}, "reason")])
def test_a_bad_force_or_reason_is_refused_with_a_message(app_factory: Any, params: dict[str, str], field: str) -> None:
    with app_factory() as c:
        register(c, run="a", world_size=1)
        _finish(c, "a")
        resp = c.delete("/v1/runs/a", params=params)
        assert resp.status_code == 422 and resp.json()["errors"][0]["loc"] == ["query", field]
        assert _names(c) == ["a"]


def test_incident_ids_of_a_deleted_run_are_not_given_again_after_a_restart(tmp_path: Any, monkeypatch: Any) -> None:
    import itertools

    from trainguard.service.recovery import incident

    settings = Settings(db=tmp_path / "tg.db", tick_s=60)
    with TestClient(create_app(settings)) as c:
        register(c, run="old", world_size=1)
        climb_ladder(c, "old")  # an incident, escalated: the run is paused
        old_ids = [i["id"] for i in c.get("/v1/runs/old/incidents").json()["incidents"]]
        assert len(old_ids) == 1 and c.delete("/v1/runs/old", params={"force": "true"}).status_code == 200
    monkeypatch.setattr(incident, "_ids", itertools.count(1))  # a new process numbers from what it reads back
    with TestClient(create_app(settings)) as c:
        register(c, run="new", world_size=1)
        climb_ladder(c, "new")
        new_ids = [i["id"] for i in c.get("/v1/runs/new/incidents").json()["incidents"]]
    assert new_ids == [old_ids[0] + 1]


def test_a_long_poll_waiting_on_a_deleted_run_keeps_waiting_without_spinning(app_factory: Any) -> None:
    """A long-poll of the run waits for its end as before (the next one is 404); waking it without
    a new desired state made its loop find the event set at each turn until its deadline."""
    import asyncio

    from trainguard.service.auth import ANONYMOUS

    waits: list[int] = []

    class CountingEvent(asyncio.Event):
        async def wait(self) -> bool:  # type: ignore[override]
            waits.append(1)
            return await super().wait()

    async def poll_across_a_deletion(ctl: Any) -> int:
        st = ctl.runs["a"]
        st.publication.changed = CountingEvent()
        poll = asyncio.create_task(ctl.wait_desired("a", 0, 3600, ANONYMOUS))
        await asyncio.sleep(0)
        await ctl.delete_run("a", actor="test", force=False, reason="")
        for _ in range(50):
            await asyncio.sleep(0)
        turns = len(waits)
        ctl.agent_calls.closing = True  # end the poll
        st.publication.changed.set()
        await poll
        return turns

    with app_factory() as c:
        register(c, run="a", world_size=1)
        _finish(c, "a")
        assert c.portal.call(poll_across_a_deletion, c.app.state.controller) == 1
        assert c.get("/v1/runs/a/desired", params={"after": 0}).status_code == 404
