"""The absence ticker's pruning: reports older than the retention are deleted oldest first, in
transactions of a bounded size, a bounded number a tick, the rest at the next ticks; once an hour."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from trainguard.service import absence_ticker
from trainguard.service import deletion_statements as deletion
from trainguard.service.app import create_app
from trainguard.service.config import Settings
from tests.service.conftest import register

T0 = 1_000_000.0


def test_old_reports_are_pruned_in_transactions_of_a_bounded_size(store_db: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr(absence_ticker, "PRUNE_REPORTS", 3)
    monkeypatch.setattr(absence_ticker, "PRUNE_BATCHES", 2)
    deleted: list[int] = []  # what each prune transaction deleted
    prune = deletion.prune_reports

    def prune_reports(conn: Any, before: float, limit: int) -> int:
        deleted.append(prune(conn, before, limit))
        return deleted[-1]

    monkeypatch.setattr(deletion, "prune_reports", prune_reports)
    now = [T0]
    with TestClient(create_app(Settings(db=store_db, tick_s=60, report_retention_s=1000), clock=lambda: now[0])) as c:
        register(c, world_size=1)
        for step in range(8):  # received at T0 + step
            now[0] = T0 + step
            body = {"job": "job-a", "step_first": step, "step_last": step, "time": float(step), "values": {"trainguard_loss": 1.0}}
            assert c.post("/v1/runs/run-1/reports", json=body).status_code == 200
        ctl = c.app.state.controller

        def received() -> list[float]:
            return ctl.store.read_now(lambda conn: [r[0] - T0 for r in conn.execute("SELECT received FROM reports ORDER BY received")])

        now[0] = T0 + 1006.5  # the reports of steps 0-6 are older than the retention
        c.portal.call(ctl.tick)
        assert deleted == [3, 3] and received() == [6.0, 7.0]  # two transactions of three, the oldest first
        c.portal.call(ctl.tick)
        assert deleted == [3, 3, 1] and received() == [7.0]  # the rest at the next tick
        now[0] += 3599.0
        c.portal.call(ctl.tick)
        assert deleted == [3, 3, 1]  # nothing until an hour after the last prune began
        now[0] += 2.0
        c.portal.call(ctl.tick)
        assert deleted == [3, 3, 1, 1] and received() == []
