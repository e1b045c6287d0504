"""One transaction path (service.transaction): a commit that fails leaves the controller's memory
exactly as before — the rule window, the alert book (firing, last fire, cap count), the desired
state, acks — so a retried report counts once and a NaN still pauses the run. On each backend: a
SQLite file whose write lock another connection holds, a PostgreSQL database whose tables another
connection has locked."""

from __future__ import annotations

import math
import sqlite3
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
from fastapi.testclient import TestClient

from trainguard.service.app import create_app
from trainguard.service.config import Settings
from trainguard.service.engine import AlertBook
from trainguard.service.evaluate import Finding
from trainguard.service.rules import default_rules_text, load_rules
from trainguard.service.store import Store, open_store
from trainguard.service.window import VECTORS, RunWindow
from tests.service.conftest import register

NAN_REPORT = b'{"job":"job-a","step_first":2,"step_last":2,"time":2.0,"values":{"trainguard_loss":NaN}}'


@pytest.fixture
def locked_app(store_db: Any) -> Iterator[tuple[TestClient, Any, list[float], Any]]:
    """An app whose writes give up after 100 ms on a lock held elsewhere, on a settable clock."""
    db, now = store_db, [1_000.0]
    app = create_app(Settings(db=db), store=open_store(db, busy_timeout_ms=100), clock=lambda: now[0])
    with TestClient(app) as c:
        register(c)
        yield c, app.state.controller, now, db


class WriteLock:
    """Another connection holding the database's write lock until released (SQLite); holding
    every table the controller writes locked against writers (PostgreSQL)."""

    def __init__(self, db: Any) -> None:
        if isinstance(db, Path):
            self.conn = sqlite3.connect(db, isolation_level=None)
            self.conn.execute("BEGIN IMMEDIATE")
            return
        import psycopg

        self.conn = psycopg.connect(db, autocommit=True)
        self.conn.execute("BEGIN")
        self.conn.execute("LOCK TABLE runs, reports, alerts, events, outbox IN EXCLUSIVE MODE")

    def release(self) -> None:
        self.conn.execute("ROLLBACK")
        self.conn.close()


def _post(c: TestClient, body: bytes) -> Any:
    return c.post("/v1/runs/run-1/reports", content=body, headers={"content-type": "application/json"})


def test_nan_report_refused_under_a_write_lock_pauses_when_retried(locked_app) -> None:
    c, ctl, now, db = locked_app
    ok = b'{"job":"job-a","step_first":1,"step_last":1,"time":1.0,"values":{"trainguard_loss":2.0}}'
    assert _post(c, ok).status_code == 200
    st = ctl.runs["run-1"]
    before = (st.window.count, st.book.firing(), st.desired, dict(st.firing), st.applied.reported)

    lock = WriteLock(db)
    try:
        now[0] += 1
        assert _post(c, NAN_REPORT).status_code == 503
        # memory exactly as before: window, alert book, desired state, firing alerts
        assert (st.window.count, st.book.firing(), st.desired, dict(st.firing), st.applied.reported) == before
        assert st.window.series("trainguard_loss", 10).tolist() == [2.0]
        detail = c.get("/v1/runs/run-1").json()
        assert detail["reports"] == 1 and detail["last_step"] == 1 and detail["status"] == "running"
    finally:
        lock.release()

    now[0] += 1  # well within the rule's cooldown: an alert whose commit failed has not fired
    r = _post(c, NAN_REPORT)
    assert r.status_code == 200, r.text
    assert r.json()["alerts"] == ["loss_nonfinite"] and r.json()["desired"]["paused"] is True
    loss = st.window.series("trainguard_loss", 10)
    assert len(loss) == 2 and loss[0] == 2.0 and math.isnan(loss[1])  # the retried report counted once
    assert c.get("/v1/runs/run-1").json()["reports"] == 2
    kinds = [e["kind"] for e in c.get("/v1/runs/run-1/events").json()]
    assert kinds == ["registered", "alert", "desired", "incident"]  # the refused rollback paused: escalated
    stored = ctl.store.read_now(lambda conn: [tuple(r) for r in conn.execute("SELECT seq, step_last FROM reports ORDER BY seq")])
    assert stored == [(1, 1), (2, 2)]


def test_refused_command_and_ack_leave_no_trace(locked_app) -> None:
    c, ctl, now, db = locked_app
    st = ctl.runs["run-1"]
    lock = WriteLock(db)
    try:
        assert c.post("/v1/runs/run-1/pause", json={"reason": "r"}).status_code == 503
        assert st.desired.generation == 0 and not st.desired.paused and c.get("/v1/runs/run-1").json()["status"] == "registered"
    finally:
        lock.release()
    assert c.post("/v1/runs/run-1/pause", json={"reason": "r"}).json()["desired"]["generation"] == 1
    lock = WriteLock(db)
    try:
        assert c.post("/v1/runs/run-1/acks", json={"generation": 1, "step": 7}).status_code == 503
        assert (st.applied.generation, st.applied.step, st.applied.at) == (0, None, None)
    finally:
        lock.release()
    assert c.post("/v1/runs/run-1/acks", json={"generation": 1, "step": 7}).json()["recorded"] is True


def test_window_rollback_restores_the_overwritten_row() -> None:
    w = RunWindow(capacity=2, rank_capacity=1, world_size=2, created=0.0)
    w.append_raw({"a": 1.0}, {}, 1, 1.0)
    w.append_raw({"a": 2.0}, {VECTORS[0]: np.array([1.0, 2.0])}, 2, 2.0)
    saved = w.save_next(ranks=True)
    w.append_raw({"a": 3.0, "new": 9.0}, {VECTORS[0]: np.array([5.0, 6.0])}, 3, 3.0)  # overwrites row 0, adds a column
    assert w.rollback(saved)
    assert w.count == 2 and w.last_received == 2.0 and w.last_step == 2
    assert w.series("a", 5).tolist() == [1.0, 2.0]
    assert w.series("new", 5).size == 0  # the column stays, empty
    assert w.rank_history(VECTORS[0], 5).tolist() == [[1.0, 2.0]]
    saved = w.save_next(ranks=False)
    w.append_raw({"a": 4.0}, {}, 4, 4.0)
    w.append_raw({"a": 5.0}, {}, 5, 5.0)
    assert not w.rollback(saved)  # not the newest append any more: left alone
    assert w.count == 4


def test_alert_book_undo_restores_firing_cooldown_and_cap() -> None:
    rule = next(r for r in load_rules(default_rules_text()).base if r.name == "loss_nonfinite")
    book = AlertBook()
    fire = [Finding(rule=rule, active=True, summary="s", values={})]
    first = book.transition(fire, 10.0, complete=False)
    assert [f.rule.name for f in first.fire] == ["loss_nonfinite"]
    book.undo(first.prior)
    assert book.firing() == []
    again = book.transition(fire, 11.0, complete=False)  # no cooldown left behind by the undone fire
    assert [f.rule.name for f in again.fire] == ["loss_nonfinite"] and again.suppressed == []
    cleared = book.transition([Finding(rule=rule, active=False, summary="", values={})], 12.0, complete=False)
    assert cleared.resolve == ["loss_nonfinite"]
    book.undo(cleared.prior)
    assert book.firing() == ["loss_nonfinite"]
