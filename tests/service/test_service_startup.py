"""service/startup.py: a restarted controller listens at once, says it is loading until its runs
are read back (``/readyz`` 503 with the progress, requests that need the runs 503 with
Retry-After), then holds exactly the rule state it held before it stopped; no report sent
meanwhile is lost; what it reads per run is one range scan of an index."""

from __future__ import annotations

import math
import random
import sqlite3
import threading
from pathlib import Path
from typing import Any, Iterator

import httpx
import numpy as np
import pytest
import uvicorn
from fastapi.testclient import TestClient

from trainer_agent.report.client import ControllerClient
from trainguard.protocol.wire import RankEndpoint, Report, RunRegistration
from trainguard.service import statements as sql
from trainguard.service.app import create_app
from trainguard.service.config import Settings
from trainguard.service.store import Store
from trainguard.service.window import VECTORS
from tests.service.conftest import LADDER_STEPS, climb_ladder, register, wait_until

OP = "op-token-startup-1"


def _rule_state(ctl: Any) -> dict[str, Any]:
    """Everything the rules and the status pages read of each run, as plain values (NaN as a
    string, so that equal states compare equal)."""

    def plain(v: Any) -> Any:
        if isinstance(v, float) and math.isnan(v):
            return "NaN"
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, np.ndarray):
            return plain(v.tolist())
        return v

    out = {}
    for name, st in sorted(ctl.runs.items()):
        w = st.window
        out[name] = plain({
            "count": w.count, "size": w.size, "last_received": w.last_received, "last_step": w.last_step,
            "rows": w.rows(), "rank_rows": w.rank_rows(), "latest": w.latest_values(),
            # what a rule reads: every series over the whole window, every per-rank history
            "series": {m: w.series(m, w.capacity) for m in w.columns if w.series(m, w.capacity).size},
            "ranks": {v: w.rank_history(v, w.rank_capacity) for v in VECTORS if v in w.vectors_seen},
            "desired": st.desired.model_dump(), "published": st.publication.desired.model_dump(),
            "applied": [st.applied.generation, st.applied.step, st.applied.at], "live_since": st.live_since,
            "incidents": [i.as_dict() for i in st.recovery.incidents],
            "open": None if st.recovery.open is None else st.recovery.open.id,
            "firing": st.firing, "last_report": st.last_report, "finished": st.finish.at, "status": st.status,
        })
    return out


def _fill(c: TestClient) -> None:
    """Runs with more stored reports than the window holds, metrics that skip reports, NaN,
    per-rank vectors, an open incident, a paused run, firing alerts, a run without reports."""
    rng = random.Random(7)
    register(c, run="run-a", world_size=4)
    for step in range(1, 181):  # 180 reports: more than the window's 128
        values = {"trainguard_loss": 3.0 - 0.01 * step + rng.uniform(-0.01, 0.01)}
        if step % 2:
            values["trainguard_grad_norm"] = rng.uniform(0.5, 1.5)  # every other report
        if step == 180:  # the last: its alert still fires
            values["trainguard_loss"] = "NaN"  # (the wire spells it so)
        body = {"job": "job-a", "step_first": step, "step_last": step, "time": float(step), "values": values,
                "ranks": {"step_time_s": [0.1 + rng.uniform(0, 0.01) for _ in range(4)]}}
        resp = c.post("/v1/runs/run-a/reports", json=body)
        assert resp.status_code == 200, resp.text
    register(c, run="run-b", world_size=1)
    climb_ladder(c, "run-b", until=LADDER_STEPS["rollback"])  # opened, adaptive LR, rolled back: still open
    register(c, run="run-c", world_size=2)
    for step in range(1, 11):
        assert c.post("/v1/runs/run-c/reports", json={"job": "job-a", "step_first": step, "step_last": step,
                                                        "time": float(step), "values": {"trainguard_loss": 2.0}}).status_code == 200
    assert c.post("/v1/runs/run-c/pause", json={"reason": "operator"}).status_code == 200
    register(c, run="run-d", world_size=2)


class _HeldLoad:
    """Holds the app's read-back of the runs until :meth:`release` (the controller answers meanwhile)."""

    def __init__(self, app: Any) -> None:
        ctl = app.state.controller
        self.started, self.go = threading.Event(), threading.Event()
        load = ctl.load

        def held(progress: Any = None) -> None:
            self.started.set()
            assert self.go.wait(120), "the test never released the load"
            load(progress)

        ctl.load = held

    def release(self) -> None:
        self.go.set()


def test_restart_loads_in_the_background_and_rebuilds_the_same_rule_state(tmp_path: Path) -> None:
    db = tmp_path / "tg.db"
    with TestClient(create_app(Settings(db=db, tick_s=60))) as c:
        _fill(c)
        before = _rule_state(c.app.state.controller)
        assert before["run-b"]["open"] is not None and before["run-c"]["desired"]["paused"] is True
        assert before["run-a"]["count"] == 180 and before["run-a"]["size"] == 128
        assert len(before["run-a"]["series"]["trainguard_grad_norm"]) == 64  # skips reports: half the window
        assert before["run-a"]["firing"]  # the NaN's alert
    app = create_app(Settings(db=db, tick_s=60, startup_wait_runs=0))  # any database loads in the background
    held = _HeldLoad(app)
    with TestClient(app) as c:
        assert held.started.wait(60)
        r = c.get("/readyz")
        assert r.status_code == 503 and r.json() == {
            "status": "loading: 0 of 4 runs read back from the database", "runs_loaded": 0, "runs_total": 4}
        assert c.get("/healthz").status_code == 200 and c.get("/healthz").json() == {"status": "loading"}
        report = {"job": "job-a", "step_first": 181, "step_last": 181, "time": 181.0,
                  "values": {"trainguard_loss": 1.2}, "ranks": {"step_time_s": [0.1, 0.1, 0.1, 0.1]}}
        for method, path, body in (("POST", "/v1/runs/run-a/reports", report), ("GET", "/v1/runs", None),
                                   ("GET", "/v1/runs/run-a", None), ("POST", "/v1/runs/run-c/resume", {"reason": "x"}),
                                   ("POST", "/v1/runs", {"job": "job-a", "run": "run-e", "world_size": 1, "ranks": []})):
            r = c.request(method, path, json=body)
            assert r.status_code == 503, (path, r.text)
            assert r.headers["retry-after"] == "2" and r.headers["x-trainguard-role"] == "loading"
            assert r.json()["detail"] == ("the controller is starting (loading: 0 of 4 runs read back from the "
                                          "database): try again shortly")
        assert c.app.state.controller.runs == {}  # nothing was read yet, nothing was stored
        held.release()
        wait_until(lambda: c.get("/readyz").status_code == 200)
        assert c.get("/healthz").json() == {"status": "ok"} and c.get("/readyz").json() == {"status": "ok"}
        assert _rule_state(c.app.state.controller) == before
        # the report refused while loading, sent again, is taken as the 181st
        r = c.post("/v1/runs/run-a/reports", json=report)
        assert r.status_code == 200, r.text
        assert c.get("/v1/runs/run-a").json()["reports"] == 181


def test_small_database_is_read_before_the_first_answer(tmp_path: Path) -> None:
    """At most ``startup_wait_runs`` runs: read back before anything is answered (no 503 at all)."""
    db = tmp_path / "tg.db"
    with TestClient(create_app(Settings(db=db))) as c:
        register(c, run="run-a", world_size=1)
    with TestClient(create_app(Settings(db=db, startup_wait_runs=1))) as c:
        assert c.app.state.startup.ready and "run-a" in c.app.state.controller.runs
        assert c.get("/readyz").status_code == 200


def test_a_failed_load_is_shown_and_tried_again(tmp_path: Path) -> None:
    db = tmp_path / "tg.db"
    with TestClient(create_app(Settings(db=db))) as c:
        register(c, run="run-a", world_size=1)
    app = create_app(Settings(db=db, startup_wait_runs=0))
    ctl, loader = app.state.controller, app.state.startup
    loader.retry_s = 0.05
    load, attempts, go = ctl.load, [], threading.Event()

    def flaky(progress: Any = None) -> None:
        attempts.append(1)
        if len(attempts) == 1:
            raise sqlite3.OperationalError("disk I/O error")
        assert go.wait(60)  # the second attempt waits for the test
        load(progress)

    ctl.load = flaky
    with TestClient(app) as c:
        wait_until(lambda: len(attempts) == 2)
        status = "loading: 0 of 1 runs read back from the database; the last attempt failed (OperationalError: disk I/O error), trying again"
        r = c.get("/healthz")
        assert r.status_code == 503 and r.json()["status"] == status
        assert c.get("/readyz").json()["status"] == status
        go.set()
        wait_until(lambda: c.get("/readyz").status_code == 200)
        assert "run-a" in ctl.runs and loader.error is None and c.get("/healthz").json() == {"status": "ok"}


def test_agent_keeps_its_reports_while_the_controller_loads_and_none_is_lost(tmp_path: Path) -> None:
    """A real agent client over HTTP: its reports answered 503 'loading' stay queued (not dropped,
    not refused) and go through, in order, once the runs are read back; with two controller URLs it
    does not move on to the other (a standby) because of the loading answer."""
    db = tmp_path / "tg.db"
    with TestClient(create_app(Settings(db=db))) as c:
        register(c, run="run-a", world_size=2)
        for step in range(1, 6):
            assert c.post("/v1/runs/run-a/reports", json={"job": "job-a", "step_first": step, "step_last": step,
                                                            "time": float(step), "values": {"trainguard_loss": 2.0}}).status_code == 200
    app = create_app(Settings(db=db, startup_wait_runs=0, tick_s=60))
    held = _HeldLoad(app)
    asked: list[str] = []

    async def counted(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            asked.append(scope["path"])
        await app(scope, receive, send)

    server = uvicorn.Server(uvicorn.Config(counted, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    standby_asked: list[str] = []

    def standby(request: httpx.Request) -> httpx.Response:
        standby_asked.append(request.url.path)
        return httpx.Response(503, json={"detail": "standby"}, headers={"x-trainguard-role": "standby", "retry-after": "1"})

    standby_server = _Answering(standby)
    try:
        wait_until(lambda: server.started)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        assert held.started.wait(60)
        reg = RunRegistration(job="job-a", run="run-a", world_size=2, agent_version="test",
                              ranks=[RankEndpoint(rank=r, local_rank=r, host="127.0.0.1", port=9100 + r) for r in range(2)])
        client = ControllerClient(f"{url},{standby_server.url}", registration=reg, backoff_initial_s=0.05,
                                  backoff_max_s=0.2, long_poll_s=0.5)
        client.start()
        for step in range(6, 16):
            client.submit_report(Report(job="job-a", step_first=step, step_last=step, time=float(step),
                                        values={"trainguard_loss": 2.0 - 0.01 * step}))
        wait_until(lambda: sum(p.startswith("/v1/") for p in asked) >= 3)  # answered 'loading' a few times
        assert client.counts.reports_sent == 0 and client.counts.reports_dropped == 0 and client.counts.refused == 0
        assert standby_asked == []  # the loading controller holds the database: the agent waited for it
        held.release()
        wait_until(lambda: client.counts.reports_sent == 10)
        assert client.close(10.0)
        status = httpx.get(f"{url}/v1/runs/run-a").json()
        assert status["reports"] == 15 and status["last_step"] == 15
        rows = app.state.controller.runs["run-a"].window.rows()
        assert [step for _, step, _, _ in rows] == list(range(1, 16))  # every report, in order, once
        assert client.counts.reports_dropped == 0 and client.counts.refused == 0
    finally:
        held.release()
        server.should_exit = True
        thread.join(30)
        standby_server.close()


class _Answering:
    """A loopback HTTP server answering every request with ``answer(httpx.Request)``."""

    def __init__(self, answer: Any) -> None:
        import http.server

        class Handler(http.server.BaseHTTPRequestHandler):
            def _any(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
                resp = answer(httpx.Request(self.command, f"http://x{self.path}", content=body))
                self.send_response(resp.status_code)
                for k, v in resp.headers.items():
                    if k.lower() not in ("content-length",):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(resp.content)))
                self.end_headers()
                self.wfile.write(resp.content)

            do_GET = do_POST = _any  # noqa: N815

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_what_a_start_up_reads_per_run_is_a_range_scan_of_an_index(tmp_path: Path) -> None:
    """SQLite's plan of each start-up read: a search of an index, never a scan of a table
    (``SELECT * FROM runs``, one row per run, aside)."""
    store = Store(tmp_path / "tg.db")
    try:
        queries = {  # the query, its arguments, the search SQLite must make (the index and its key)
            "recent_reports": ("SELECT seq FROM reports WHERE run_id=? ORDER BY seq DESC LIMIT ?", (1, 128),
                               "(run_id=?)"),
            "recent_incidents": ("SELECT data FROM events WHERE run_id = ? AND kind = 'incident' ORDER BY id DESC LIMIT ?",
                                 (1, 1600), "events_run_kind (run_id=? AND kind=?)"),  # not the run's every event
            "recent_fire_times": ("SELECT run_id, rule, starts_at FROM alerts WHERE starts_at>=?", (0.0,),
                                  "alerts_starts (starts_at>?)"),
        }

        def plan(c: sqlite3.Connection, q: str, args: tuple[Any, ...]) -> str:
            return " | ".join(r[3] for r in c.execute("EXPLAIN QUERY PLAN " + q, args))

        for name, (q, args, search) in queries.items():
            text = store.read_now(lambda c: plan(c, q, args))
            assert text.startswith("SEARCH") and search in text and "TEMP B-TREE" not in text, (name, text)
        # the statements themselves are these queries
        import inspect
        assert "WHERE run_id=? ORDER BY seq DESC LIMIT ?" in inspect.getsource(sql.recent_reports)
        assert "kind = 'incident' ORDER BY id DESC" in inspect.getsource(sql.recent_incidents)
        assert "MAX(" not in inspect.getsource(sql.all_runs)  # no aggregate over a run's every report
    finally:
        store.close()


def test_a_controller_taking_the_lease_says_loading_not_standby(postgres_url: str) -> None:
    """PostgreSQL: the controller that takes the writer lease answers 'loading' (its role header
    says so: an agent waits for it) until its runs are read back, then serves."""
    with TestClient(create_app(Settings(db=postgres_url, tick_s=60))) as c:
        register(c, run="run-a", world_size=1)
        assert c.post("/v1/runs/run-a/reports", json={"job": "job-a", "step_first": 1, "step_last": 1, "time": 1.0,
                                                        "values": {"trainguard_loss": 2.0}}).status_code == 200
        before = _rule_state(c.app.state.controller)
    app = create_app(Settings(db=postgres_url, tick_s=60, startup_wait_runs=0))
    held = _HeldLoad(app)
    with TestClient(app) as c:
        assert held.started.wait(60)
        r = c.get("/readyz")
        assert r.status_code == 503 and r.headers["x-trainguard-role"] == "loading"
        assert r.json()["status"] == "loading: 0 of 1 runs read back from the database"
        r = c.get("/v1/runs")
        assert r.status_code == 503 and r.headers["x-trainguard-role"] == "loading"
        held.release()
        wait_until(lambda: c.get("/readyz").status_code == 200)
        assert _rule_state(c.app.state.controller) == before


@pytest.mark.parametrize("n", [1, 5, 8, 13, 30])
@pytest.mark.parametrize("count0", [0, 37])
def test_reports_read_back_in_one_pass_leave_the_window_as_one_by_one(n: int, count0: int) -> None:
    """``RunWindow.append_many`` (the read-back of the older reports) against ``append_raw`` of
    each in turn: metrics that come, skip reports and go, NaN, more reports than the capacity."""
    from trainguard.service.window import RunWindow

    rng = random.Random(n * 100 + count0)
    names = [f"m{i}" for i in range(20)]  # more than the window's 16 initial columns
    values, steps, received = [], [], []
    for j in range(n):
        keys = rng.sample(names[: 4 + j % 17], rng.randint(1, 4 + j % 17))
        values.append({k: (math.nan if rng.random() < 0.1 else rng.uniform(-1, 1)) for k in keys})
        steps.append(10 * j)
        received.append(1000.0 + j)
    one, many = (RunWindow(capacity=8, rank_capacity=2, world_size=2, created=5.0) for _ in range(2))
    for w in (one, many):
        w.count = count0
    for v, s, r in zip(values, steps, received):
        one.append_raw(v, {}, s, r)
    many.append_many(values, steps, received)
    assert many.columns == one.columns and many.count == one.count == count0 + n
    assert many._absent_at == one._absent_at and many._absent_cols == one._absent_cols and many._keys == one._keys
    np.testing.assert_array_equal(many._present2, one._present2)
    np.testing.assert_array_equal(many._values2, one._values2)  # NaN equal to NaN
    np.testing.assert_array_equal(many._received, one._received)
    np.testing.assert_array_equal(many._step, one._step)
    assert many.rows() == one.rows() or _nan_equal(many.rows(), one.rows())
    for m in names:
        for last in (1, 3, 8):
            np.testing.assert_array_equal(many.series(m, last), one.series(m, last))
    assert many.last_received == one.last_received and many.last_step == one.last_step


def _nan_equal(a: Any, b: Any) -> bool:
    return repr(a) == repr(b)
