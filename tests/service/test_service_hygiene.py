"""Operational hygiene: readiness apart from liveness, an owner-only database file, webhook URLs
kept out of logs, finished runs refusing reports, and a bounded Alertmanager de-duplication memory
that still never acts on one alert twice."""

from __future__ import annotations

import logging
import os
import sqlite3
import stat

from tests.service.conftest import register, wait_until
from trainguard.service.alertmanager import SeenKeys

REPORT = {"job": "job-a", "step_first": 1, "step_last": 1, "time": 1.0, "values": {"trainguard_loss": 1.0}}


def test_readiness_fails_while_writes_wait_for_a_lock_and_liveness_stays(app_factory, tmp_path) -> None:
    with app_factory() as c:
        assert c.get("/readyz").status_code == 200
        lock = sqlite3.connect(tmp_path / "tg.db", isolation_level=None)
        lock.execute("BEGIN IMMEDIATE")
        try:
            r = c.get("/readyz")
            assert r.status_code == 503 and "lock" in r.json()["status"]
            assert c.get("/healthz").status_code == 200
        finally:
            lock.execute("ROLLBACK")
            lock.close()
        wait_until(lambda: c.get("/readyz").status_code == 200)


def _fill_the_disk(c) -> dict:
    """Reports until one is refused for want of room (SQLite's file may grow by three pages more,
    as in test_service_store.py); the report refused."""
    writer = c.app.state.controller.store._conn
    writer.execute(f"PRAGMA max_page_count={writer.execute('PRAGMA page_count').fetchone()[0] + 3}")
    for step in range(1000):
        body = {"job": "job-a", "step_first": step, "step_last": step, "time": 1.0, "values": {f"m{i}": 1.0 for i in range(100)}}
        r = c.post("/v1/runs/run-1/reports", json=body)
        if r.status_code != 200:
            assert (r.status_code, r.json()["detail"]) == (503, "database commit failed: database or disk is full")
            return body
    raise AssertionError("the disk never filled")


def test_readiness_fails_while_the_disk_is_full_and_comes_back_with_room(app_factory) -> None:
    """A full disk (the empty transaction of the probe still commits): /readyz answers 503 naming it,
    so that traffic goes elsewhere, and 200 again once a write that needs room commits."""
    with app_factory(tick_s=60) as c:
        register(c, world_size=1)
        body = _fill_the_disk(c)
        r = c.get("/readyz")
        assert (r.status_code, r.json()) == (503, {"status": "database writes fail: database commit failed: database or "
                                                             "disk is full"})
        assert c.get("/readyz").status_code == 503  # (still no room: the probe's row does not fit)
        assert c.get("/healthz").status_code == 200
        c.app.state.controller.store._conn.execute("PRAGMA max_page_count=1073741823")
        r = c.get("/readyz")
        assert (r.status_code, r.json()) == (200, {"status": "ok"})
        assert c.post("/v1/runs/run-1/reports", json=body).status_code == 200
        assert c.get("/readyz").status_code == 200


def test_readiness_fails_after_a_full_disk_on_each_backend(store_db, monkeypatch) -> None:
    """Each backend's own full-disk error (SQLite's SQLITE_FULL, PostgreSQL's disk_full) of a write
    makes /readyz 503 until the probe's row commits."""
    import psycopg
    from fastapi.testclient import TestClient
    from trainguard.service import group_commit
    from trainguard.service.app import create_app
    from trainguard.service.config import Settings

    if isinstance(store_db, str):
        full: Exception = psycopg.errors.DiskFull("could not extend file: No space left on device")
    else:
        full = sqlite3.OperationalError("database or disk is full")
        full.sqlite_errorcode = sqlite3.SQLITE_FULL
    real_probe = group_commit._probe_room

    def no_room(conn) -> None:
        raise full

    with TestClient(create_app(Settings(db=store_db, tick_s=60))) as c:
        store = c.app.state.controller.store
        monkeypatch.setattr(group_commit, "_probe_room", no_room)
        assert c.get("/readyz").status_code == 200  # no write failed yet: the empty probe
        c.portal.call(lambda: _fails(store.submit(no_room)))
        r = c.get("/readyz")
        assert r.status_code == 503 and str(full) in r.json()["status"]
        monkeypatch.setattr(group_commit, "_probe_room", real_probe)
        assert c.get("/readyz").status_code == 200 and store.out_of_room is None
        assert store.read_now(lambda conn: conn.execute("SELECT COUNT(*) FROM room_probe").fetchone()[0]) == 0


def test_readiness_fails_while_the_sqlite_disk_has_less_room_than_its_bound(store_db, tmp_path) -> None:
    """An idle controller writes nothing that would find a full disk: /readyz reads the SQLite
    database's file system's free space (more than any disk holds for the bound of 2**62 bytes), and
    a write still commits meanwhile (nothing is refused, the controller stops taking traffic). A
    PostgreSQL server's room is not read (its writes find out)."""
    import re
    from fastapi.testclient import TestClient
    from trainguard.service.app import create_app
    from trainguard.service.config import Settings

    with TestClient(create_app(Settings(db=store_db, tick_s=60, min_free_bytes=2**62))) as c:
        r = c.get("/readyz")
        if isinstance(store_db, str):
            assert (r.status_code, r.json()) == (200, {"status": "ok"})
            return
        st = os.statvfs(tmp_path)
        assert st.f_bavail * st.f_frsize < 2**62
        assert r.status_code == 503
        assert re.fullmatch(r"the database's file system has \d+\.\d MiB free, less than TRAINGUARD_MIN_FREE_BYTES "
                            r"\(4398046511104\.0 MiB\): writes may fail at any moment; make room or give the database more",
                            r.json()["status"]), r.json()
        assert c.get("/healthz").status_code == 200
        register(c, world_size=1)
        assert c.post("/v1/runs/run-1/reports", json=REPORT).status_code == 200
    with TestClient(create_app(Settings(db=store_db, tick_s=60, min_free_bytes=1))) as c:
        assert (c.get("/readyz").status_code, c.get("/readyz").json()) == (200, {"status": "ok"})


async def _fails(fut) -> None:
    try:
        await fut
    except Exception:
        return
    raise AssertionError("the write did not fail")


def test_database_file_is_owner_only(app_factory, tmp_path) -> None:
    old = os.umask(0o022)
    try:
        with app_factory() as c:
            register(c)
            for name in ("tg.db", "tg.db-wal"):
                mode = stat.S_IMODE(os.stat(tmp_path / name).st_mode)
                assert mode & 0o077 == 0, (name, oct(mode))
    finally:
        os.umask(old)


def test_webhook_url_path_never_reaches_the_log(app_factory, receiver_factory, caplog) -> None:
    rx = receiver_factory([500])
    secret_path = "/services/T000/B000/XXXXsecretXXXX"
    url = rx.url.replace("/hook", secret_path)
    caplog.set_level(logging.WARNING, logger="trainguard")
    with app_factory(webhook_backoff_s=0.01, webhook_backoff_max_s=0.01, webhook_max_attempts=2) as c:
        assert c.post("/v1/webhooks", json={"url": url, "min_severity": "info"}).status_code in (200, 201)
        register(c, world_size=1)
        nan = dict(REPORT, values={"trainguard_loss": "NaN"})
        assert c.post("/v1/runs/run-1/reports", json=nan).json()["alerts"]
        wait_until(lambda: any("delivery" in r.getMessage() for r in caplog.records))
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "XXXXsecretXXXX" not in text and "127.0.0.1" in text


def test_reports_of_a_finished_run_are_refused_until_it_registers_again(app_factory) -> None:
    with app_factory() as c:
        register(c, world_size=1)
        assert c.post("/v1/runs/run-1/reports", json=REPORT).status_code == 200
        assert c.post("/v1/runs/run-1/finish", json={"step": 1, "reason": "done"}).status_code == 200
        r = c.post("/v1/runs/run-1/reports", json=dict(REPORT, step_first=2, step_last=2))
        assert r.status_code == 409 and "finished" in r.json()["detail"]
        assert c.get("/v1/runs/run-1").json()["reports"] == 1
        assert 'reason="finished"' in c.get("/metrics").text
        register(c, world_size=1)
        assert c.post("/v1/runs/run-1/reports", json=dict(REPORT, step_first=2, step_last=2)).status_code == 200


def _am(fp: str) -> dict:
    return {"version": "4", "status": "firing", "alerts": [{
        "status": "firing", "labels": {"alertname": "X", "run": "run-1", "trainguard_action": "checkpoint"},
        "startsAt": "2026-01-01T00:00:00Z", "fingerprint": fp}]}


def test_alertmanager_dedup_memory_is_bounded_and_the_database_still_dedups(app_factory) -> None:
    with app_factory() as c:
        register(c, world_size=1)
        ctl = c.app.state.controller
        ctl.commands.seen = SeenKeys(capacity=4)
        for i in range(10):
            assert c.post("/v1/alertmanager", json=_am(f"fp{i}")).json()["results"][0]["outcome"] == "applied"
        assert len(ctl.commands.seen) == 4
        generation = c.get("/v1/runs/run-1").json()["desired"]["generation"]
        # fp0 left the memory; the database still knows it: no second checkpoint
        assert c.post("/v1/alertmanager", json=_am("fp0")).json()["results"][0]["outcome"] == "duplicate"
        assert c.post("/v1/alertmanager", json=_am("fp9")).json()["results"][0]["outcome"] == "duplicate"
        assert c.get("/v1/runs/run-1").json()["desired"]["generation"] == generation


def test_alertmanager_pause_acts_only_on_the_run_whose_target_fired(app_factory) -> None:
    with app_factory() as c:
        register(c, run="run-a", world_size=1)  # its rank is 127.0.0.1:9100
        register(c, run="run-b", world_size=1)
        def alert(run: str, instance: str, fp: str) -> dict:
            return {"version": "4", "status": "firing", "alerts": [{
                "status": "firing", "startsAt": "2026-01-01T00:00:00Z", "fingerprint": fp,
                "labels": {"alertname": "TrainguardLossNonFinite", "run": run, "instance": instance, "trainguard_action": "pause"}}]}
        # run-b's label on an alert about a target that is not run-b's: refused
        c.app.state.controller.runs["run-b"].ranks = [{"rank": 0, "local_rank": 0, "host": "10.0.0.2", "port": 9100}]
        res = c.post("/v1/alertmanager", json=alert("run-b", "127.0.0.1:9100", "f1")).json()["results"][0]
        assert res["outcome"] == "error" and "not a target of run 'run-b'" in res["detail"]
        assert c.get("/v1/runs/run-b").json()["desired"]["paused"] is False
        res = c.post("/v1/alertmanager", json=alert("run-a", "127.0.0.1:9100", "f2")).json()["results"][0]
        assert res["outcome"] == "applied" and c.get("/v1/runs/run-a").json()["desired"]["paused"] is True
