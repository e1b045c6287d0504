"""The store, on each backend (SQLite and PostgreSQL): a database written by schema version 1
(reports WITHOUT ROWID in SQLite) is migrated at start-up to the newest version and nothing is
lost; report values keep every float (NaN/Inf included) through the database's JSON; closing
commits the pending batch and waits for reads in flight."""

from __future__ import annotations

import json
import math
import sqlite3
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from trainguard.service import statements as sql
from trainguard.service.app import create_app
from trainguard.service.config import Settings
from trainguard.service.store import MIGRATIONS, Store, StoreError, open_store
from trainguard.service.window import VECTORS
from trainguard.protocol.wire import DesiredState

#: The fields of the desired state's stored JSON at each schema version since it was stored whole
#: (version 10): a field more is a new version, or a controller one version older would drop it.
_V12_DESIRED = frozenset({
    "generation", "paused", "checkpoint_seq", "stop", "stop_exit_code", "lr_scale", "rollback_seq", "rollback_step",
    "accumulation_steps", "accumulation_lr_rule", "memory_trace_seq", "verify_seq", "data_skip_until", "grad_clip_norm",
    "reset_optimizer_seq", "reset_optimizer_layers", "momentum_scale", "weight_decay_scale", "verify_float32_seq", "reason"})
DESIRED_FIELDS = {12: _V12_DESIRED, 13: _V12_DESIRED | {"data_skip_from"}}
DESIRED_FIELDS[14] = DESIRED_FIELDS[15] = DESIRED_FIELDS[16] = DESIRED_FIELDS[13]  # (14: deleted runs; 15: retention;
# 16: webhooks' deletion times)


def _v1_rows(conn: Any) -> None:
    """What a version-1 controller wrote: a run and five reports (the last loss NaN)."""
    run_id = sql.insert_run(conn, run="old-run", job="old-job", world_size=2, ranks=[], agent_version="v1", config={}, now=100.0)
    values = [{"trainguard_loss": 3.0 - 0.1 * i, "trainguard_grad_norm_max": 1.0 + i} for i in range(5)]
    values[-1]["trainguard_loss"] = math.nan
    for i, v in enumerate(values):  # as version 1 wrote them: the float64 rows of the present vectors
        conn.execute("INSERT INTO reports (run_id, seq, step_first, step_last, time, received, applied_generation, vals,"
                     " ranks_mask, ranks) VALUES (?,?,?,?,?,?,?,?,?,?)",
                     (run_id, i + 1, 10 * i, 10 * i + 9, 200.0 + i, 300.0 + i, 0, sql.dumps_values(v),
                      1 << VECTORS.index("loss"), np.array([1.0 * i, 2.0 * i]).tobytes()))


def _v1_database(path: Path) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    for stmt in MIGRATIONS[0].split(";"):
        if stmt.strip():
            conn.execute(stmt)
    conn.execute("PRAGMA user_version=1")
    conn.execute("BEGIN")
    _v1_rows(conn)
    conn.execute("COMMIT")
    conn.close()


def _v1_postgres_database(url: str) -> None:
    import psycopg

    from trainguard.service.store_postgres import Dialect, PgConnection

    with psycopg.connect(url) as raw:  # one transaction, committed on leaving
        for stmt in Dialect.ddl(MIGRATIONS[0]):
            raw.execute(stmt)
        raw.execute("CREATE TABLE trainguard_schema (version INTEGER NOT NULL)")
        raw.execute("INSERT INTO trainguard_schema VALUES (1)")
        _v1_rows(PgConnection(raw))


def _assert_migrated_columns(execute: Any) -> None:
    """The columns versions 3 to 10 added hold what an old run means."""
    lifecycle = execute("SELECT finished_at, finished_step, finish_reason, resumed_at FROM runs").fetchall()
    assert lifecycle == [(None, None, None, None)]  # version 3: an old run is live, never resumed
    # version 4: an old run keeps its own accumulation steps, the LR untouched
    assert execute("SELECT accumulation_steps, accumulation_lr_rule FROM runs").fetchall() == [(0, "none")]
    # version 5: no runtime tokens yet, and an old run has no token owner (its binding still applies)
    assert execute("SELECT COUNT(*) FROM tokens").fetchone()[0] == 0
    assert execute("SELECT COUNT(*) FROM run_owners").fetchone()[0] == 0
    # version 6: an old run has never been rolled back
    assert execute("SELECT rollback_seq, rollback_step FROM runs").fetchall() == [(0, 0)]
    # version 7: nor asked for a memory trace or a gradient recompute check
    assert execute("SELECT memory_trace_seq, verify_seq FROM runs").fetchall() == [(0, 0)]
    # version 8: nor had steps skipped for their data
    assert execute("SELECT data_skip_until, stop_exit_code FROM runs").fetchall() == [(0, 0)]
    # version 10: the desired state is one JSON value, none yet: the old columns still say it
    assert execute("SELECT desired FROM runs").fetchall() == [(None,)]
    rows = execute("SELECT seq, step_last, received, ranks, ranks_format FROM reports ORDER BY seq").fetchall()
    assert [(r[0], r[1], r[2]) for r in rows] == [(i + 1, 10 * i + 9, 300.0 + i) for i in range(5)]
    assert np.frombuffer(rows[3][3]).tolist() == [3.0, 6.0]
    assert {r[4] for r in rows} == {0}  # version 12: the rows written before keep their float64 rows


def _assert_migrated_app(db: Any) -> None:
    """The controller on the migrated database serves the old run and continues its reports."""
    # no absence tick while the test reads (the old run's last report is decades old)
    with TestClient(create_app(Settings(db=db, tick_s=60))) as c:
        st = c.get("/v1/runs/old-run").json()
        assert st["reports"] == 5 and st["last_step"] == 49 and st["last_report_at"] == 304.0
        # the per-rank vectors written before version 12 read back as written
        rank_rows = c.app.state.controller.runs["old-run"].window.rank_rows()
        assert [(seq, v["loss"]) for seq, v in rank_rows][-2:] == [(4, [3.0, 6.0]), (5, [4.0, 8.0])]
        assert st["status"] == "running" and st["finished_at"] is None and st["live_since"] == 100.0
        assert st["last_values"] == {"trainguard_loss": "NaN", "trainguard_grad_norm_max": 5.0}
        # New reports continue the sequence after the migrated ones.
        body = {"job": "old-job", "step_first": 50, "step_last": 50, "time": 1.0, "values": {"trainguard_loss": 1.0}}
        assert c.post("/v1/runs/old-run/reports", json=body).status_code == 200
        assert c.get("/v1/runs/old-run").json()["reports"] == 6
        seqs = c.app.state.controller.store.read_now(lambda conn: [r[0] for r in conn.execute("SELECT seq FROM reports ORDER BY seq")])
    assert seqs == [1, 2, 3, 4, 5, 6]


def test_version_1_reports_survive_the_migration(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    _v1_database(db)
    Store(db).close()  # migrates
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS) == 16
    _assert_migrated_columns(conn.execute)
    ddl = conn.execute("SELECT sql FROM sqlite_master WHERE name='reports'").fetchone()[0]
    assert "WITHOUT ROWID" not in ddl.upper()
    indexes = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='index' AND tbl_name='reports'")}
    assert "reports_received" in indexes
    conn.close()
    _assert_migrated_app(db)


def test_version_1_postgres_database_is_migrated_like_sqlite(postgres_url: str) -> None:
    from trainguard.service.store_postgres import PgConnection, PostgresStore

    import psycopg

    _v1_postgres_database(postgres_url)
    store = PostgresStore(postgres_url)  # migrates
    try:
        assert store.schema_version == len(MIGRATIONS) == 16
        store.read_now(lambda c: _assert_migrated_columns(c.execute))
    finally:
        store.close()
    with psycopg.connect(postgres_url) as raw:
        types = dict(raw.execute("SELECT column_name, data_type FROM information_schema.columns WHERE table_name='reports'").fetchall())
        indexes = {r[0] for r in raw.execute("SELECT indexname FROM pg_indexes WHERE tablename='reports'")}
        # a migrated database holds what SQLite holds: 64-bit integers, doubles, bytes
        assert (types["seq"], types["received"], types["ranks"]) == ("bigint", "double precision", "bytea")
        assert "reports_received" in indexes
        assert PgConnection(raw).execute("SELECT COUNT(*) FROM reports").fetchone()[0] == 5
    _assert_migrated_app(postgres_url)


def test_each_field_of_the_stored_desired_state_came_with_a_schema_version() -> None:
    assert set(DesiredState.model_fields) == DESIRED_FIELDS[len(MIGRATIONS)], (
        "the desired state's fields changed: add a schema version (service/migrations.py) and its fields here")


def test_a_controller_one_version_older_refuses_a_database_with_a_desired_field_it_lacks(store_db: Any,
                                                                                          monkeypatch: Any) -> None:
    """A run whose data skip names its first step (data_skip_from, version 13), opened by a
    controller of version 12: refused with the versions, the stored state unchanged (a version-12
    controller would have served the skip from the restored step and written it back so)."""
    import trainguard.service.store as store_module

    with TestClient(create_app(Settings(db=store_db, tick_s=60))) as c:
        assert c.post("/v1/runs", json={"job": "j", "run": "r", "world_size": 1}).status_code == 200
        assert c.post("/v1/runs/r/pause", json={"reason": "stored"}).status_code == 200
        store = c.app.state.controller.store
        stored = json.loads(store.read_now(lambda conn: conn.execute("SELECT desired FROM runs").fetchone()[0]))
    added = DESIRED_FIELDS[13] - DESIRED_FIELDS[12]
    assert added == {"data_skip_from"} and added <= set(stored)
    monkeypatch.setattr(store_module, "MIGRATIONS", MIGRATIONS[:12])
    if not isinstance(store_db, Path):
        import trainguard.service.store_postgres as pg_module
        monkeypatch.setattr(pg_module, "MIGRATIONS", MIGRATIONS[:12])
    with pytest.raises(StoreError, match=f"schema version {len(MIGRATIONS)}, newer than this controller \\(12\\)"):
        open_store(store_db)


def test_a_run_stored_at_schema_9_loads_the_desired_state_its_columns_held(store_db: Any, monkeypatch: Any) -> None:
    """A database last written at schema version 9 (the desired state in one column per field):
    a paused run at lr_scale 0.3 with accumulation set, opened by this controller, has that
    desired state; the next command stores the state as its JSON and a restart reads that back."""
    import trainguard.service.store as store_module

    monkeypatch.setattr(store_module, "MIGRATIONS", MIGRATIONS[:9])
    if not isinstance(store_db, Path):
        import trainguard.service.store_postgres as pg_module
        monkeypatch.setattr(pg_module, "MIGRATIONS", MIGRATIONS[:9])
    old = open_store(store_db)
    try:
        def v9_run(c: Any) -> None:  # what schema 9's update_desired wrote
            run_id = sql.insert_run(c, run="old-run", job="old-job", world_size=1, ranks=[], agent_version="v9",
                                    config={"accumulation_steps": 2}, now=100.0)
            c.execute("UPDATE runs SET generation=7, paused=1, lr_scale=0.3, checkpoint_seq=2, rollback_seq=1,"
                      " rollback_step=40, reason='paused by an incident', accumulation_steps=8,"
                      " accumulation_lr_rule='sqrt', verify_seq=3 WHERE id=?", (run_id,))
        old.write_now(v9_run)
        assert old.read_now(lambda c: c.execute("SELECT COUNT(*) FROM runs").fetchone()[0]) == 1
    finally:
        old.close()
    monkeypatch.undo()
    expected = {"generation": 7, "paused": True, "lr_scale": 0.3, "checkpoint_seq": 2, "stop": False, "rollback_seq": 1,
                "rollback_step": 40, "reason": "paused by an incident", "accumulation_steps": 8,
                "accumulation_lr_rule": "sqrt", "memory_trace_seq": 0, "verify_seq": 3, "data_skip_until": 0,
                "data_skip_from": 0,
                "stop_exit_code": 0, "grad_clip_norm": 0.0, "reset_optimizer_seq": 0, "reset_optimizer_layers": "",
                "momentum_scale": 1.0, "weight_decay_scale": 1.0, "verify_float32_seq": 0}
    with TestClient(create_app(Settings(db=store_db, tick_s=60))) as c:
        st = c.get("/v1/runs/old-run").json()
        assert st["desired"] == expected and st["status"] == "paused"
        r = c.post("/v1/runs/old-run/grad-clip", json={"max_norm": 2.5, "reason": "clip"})
        assert r.status_code == 200, r.text
        stored = c.app.state.controller.store.read_now(
            lambda conn: tuple(conn.execute("SELECT desired, generation FROM runs").fetchone()))
    assert json.loads(stored[0]) == expected | {"generation": 8, "grad_clip_norm": 2.5, "reason": "clip"} and stored[1] == 8
    with TestClient(create_app(Settings(db=store_db, tick_s=60))) as c:
        assert c.get("/v1/runs/old-run").json()["desired"] == expected | {"generation": 8, "grad_clip_norm": 2.5, "reason": "clip"}


def test_report_values_round_trip_through_their_json() -> None:
    values = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "tiny": 5e-324, "big": 1.7976931348623157e308,
              "third": 1 / 3, "neg0": -0.0, "int_like": 4e10, "unicodé": 1.5}
    text = sql.dumps_values(values)
    assert isinstance(text, str)
    back = json.loads(text)
    assert back.keys() == values.keys()
    for k, v in values.items():
        assert (math.isnan(v) and math.isnan(back[k])) or (back[k] == v and math.copysign(1, back[k]) == math.copysign(1, v)), k
    assert json.loads(sql.dumps_json(values)).keys() == back.keys()  # the same text format the other columns use


def test_close_waits_for_a_read_in_flight_and_refuses_later_reads(store_db: Any) -> None:
    import threading

    import pytest

    from trainguard.service.store import StoreError

    store = open_store(store_db)
    inside, release = threading.Event(), threading.Event()
    out: dict[str, object] = {}

    def slow_read(conn: Any) -> int:
        inside.set()
        release.wait(5)
        return conn.execute("SELECT count(*) FROM runs").fetchone()[0]

    reader = threading.Thread(target=lambda: out.setdefault("n", store.read_now(slow_read)))
    reader.start()
    assert inside.wait(5)
    closer = threading.Thread(target=store.close, kwargs={"timeout": 5.0})
    closer.start()
    closer.join(0.3)
    assert closer.is_alive()  # the reader's connection is in use: close waits for it
    release.set()
    reader.join(5)
    closer.join(5)
    assert not closer.is_alive() and out["n"] == 0  # the read finished on an open connection
    with pytest.raises(StoreError, match="closed"):
        store.read_now(lambda conn: 1)


def test_a_cancelled_caller_gets_its_outcome_through_orphaned(store_db: Any) -> None:
    """A queued write runs although its caller stopped waiting; ``orphaned`` receives the outcome
    (the controller publishes or takes back its in-memory change from it). Failures resolve
    newest first."""
    import asyncio

    store = open_store(store_db)
    store.start()
    outcomes: list[tuple[str, bool, object]] = []

    def boom(c: Any) -> None:
        raise sqlite3.IntegrityError("refused")

    async def main() -> None:
        ok = store.submit(lambda c: sql.insert_rules_version(c, "x", "api", "t", 1.0),
                          orphaned=lambda good, value: outcomes.append(("ok", good, value)))
        bad = store.submit(boom, orphaned=lambda good, value: outcomes.append(("bad", good, type(value).__name__)))
        ok.cancel()
        bad.cancel()
        # the loop's turn ends: the group commit runs (SQLite: on the loop; PostgreSQL: in a worker thread)
        for _ in range(1000):
            if len(outcomes) == 2:
                break
            await asyncio.sleep(0.005)

    try:
        asyncio.run(main())
        stored = store.read_now(sql.latest_rules)
        assert stored["text"] == "x"  # committed although nobody waited
        # the id it was given (PostgreSQL's identity may skip one that a retried batch took)
        assert outcomes == [("ok", True, stored["id"]), ("bad", False, "IntegrityError")]
    finally:
        store.close()


def test_close_commits_the_pending_batch_and_its_writers_get_their_outcome(store_db: Any) -> None:
    """Writes queued for the group commit when the store closes are committed by close(), and
    their callers get the outcome (a value, or the operation's error) instead of waiting forever."""
    import asyncio

    store = open_store(store_db)

    def refused(c: Any) -> None:
        c.execute("INSERT INTO no_such_table VALUES (1)")

    async def main() -> tuple[int, BaseException | None]:
        store.start()
        written = store.submit(lambda c: sql.insert_rules_version(c, "kept", "api", "t", 1.0))
        failed = store.submit(refused)
        store.close()  # in the same turn of the loop: the batch had not been committed
        assert written.done() and failed.done()
        return await written, failed.exception()

    version, error = asyncio.run(main())
    if isinstance(store, Store):
        assert isinstance(error, sqlite3.OperationalError) and "no_such_table" in str(error)
    else:
        import psycopg

        assert isinstance(error, psycopg.errors.UndefinedTable) and "no_such_table" in str(error)
    reopened = open_store(store_db)
    try:
        kept = reopened.read_now(sql.latest_rules)
        assert kept["text"] == "kept" and kept["id"] == version
    finally:
        reopened.close()


def test_close_from_another_thread_hands_the_outcome_to_the_writers_loop(store_db: Any) -> None:
    import asyncio
    import threading

    store = open_store(store_db)

    async def main() -> int:
        store.start()
        written = store.submit(lambda c: sql.insert_rules_version(c, "kept", "api", "t", 1.0))
        closer = threading.Thread(target=store.close)
        closer.start()
        closer.join()  # the loop is blocked here: the batch is still pending when close() runs
        return await written

    assert asyncio.run(main()) == 1


def test_a_file_that_is_not_a_database_is_refused_naming_it(tmp_path: Path) -> None:
    db = tmp_path / "tg.db"
    db.write_bytes(b"a backup archive, not the database\n" * 200)
    with pytest.raises(StoreError, match=f"^cannot use {tmp_path}/tg.db as the controller's database: file is not a database"):
        Store(db)
    assert db.read_bytes() == b"a backup archive, not the database\n" * 200


def test_a_full_disk_fails_a_report_with_its_cause_and_keeps_every_acknowledged_one(tmp_path: Path) -> None:
    """SQLite rolls the whole transaction back on a full disk (simulated: the file may grow by
    three pages): the report is answered 503 naming it, the run holds exactly the reports answered
    200, and once there is room the same report is taken."""
    with TestClient(create_app(Settings(db=tmp_path / "tg.db", tick_s=60))) as c:
        assert c.post("/v1/runs", json={"job": "j", "run": "r", "world_size": 1}).status_code == 200
        writer = c.app.state.controller.store._conn
        writer.execute(f"PRAGMA max_page_count={writer.execute('PRAGMA page_count').fetchone()[0] + 3}")
        acknowledged = 0
        for step in range(100):
            body = {"job": "j", "step_first": step, "step_last": step, "time": 1.0, "values": {f"m{i}": 1.0 for i in range(100)}}
            r = c.post("/v1/runs/r/reports", json=body)
            if r.status_code != 200:
                break
            acknowledged += 1
        assert r.status_code == 503 and r.json()["detail"] == "database commit failed: database or disk is full"
        assert 0 < acknowledged < 100 and c.get("/v1/runs/r").json()["reports"] == acknowledged
        writer.execute("PRAGMA max_page_count=1073741823")
        assert c.post("/v1/runs/r/reports", json=body).status_code == 200
        stored = c.app.state.controller.store.read_now(lambda conn: conn.execute("SELECT COUNT(*) FROM reports").fetchone()[0])
    assert stored == acknowledged + 1


def test_a_migration_is_announced_with_both_versions(tmp_path: Path, caplog: Any) -> None:
    """The start-up's log shows warnings only until the server runs: a migration (which may take a
    while on a large database) says so there; a new database is created without a word."""
    caplog.set_level("WARNING")
    _v1_database(tmp_path / "old.db")
    Store(tmp_path / "old.db").close()
    Store(tmp_path / "new.db").close()
    assert [r.getMessage() for r in caplog.records] == [f"migrating {tmp_path}/old.db from schema version 1 to {len(MIGRATIONS)}"]
