"""The retention (service/retention.py), on each backend: the hourly prune of a running controller
deletes the audit events, resolved alerts, finished webhook messages and their attempts, revoked
or expired tokens, deleted runs' rows, rules versions and keys older than their retention, keeps
what is newer and what something still needs, and commits a bounded number of batches a tick."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fastapi.testclient import TestClient

from trainguard.service import retention
from trainguard.service.app import create_app
from trainguard.service.config import Settings
from trainguard.service.retention import Retention
from trainguard.service.store import open_store
from tests.service.conftest import register

T0 = 1_000_000.0
DAY = 86400.0
OLD, NEW = T0, T0 + 7.5 * DAY  # the rows' times; the prune runs at T0 + 8 days (audit retention: 2 days)
NOW = T0 + 8 * DAY


def _rows(c: TestClient, query: str) -> list[tuple[Any, ...]]:
    return c.app.state.controller.store.read_now(lambda conn: [tuple(r) for r in conn.execute(query)])


def _write(c: TestClient, sql: str, params: tuple[Any, ...] = ()) -> None:
    c.portal.call(lambda: c.app.state.controller.store.submit(lambda conn: conn.execute(sql, params)))


def _seed(c: TestClient, at: float, tag: str, run_id: int) -> None:
    """One of each row the retention prunes, at ``at``, named by ``tag``."""
    for kind, generation in (("note", None), ("desired", 0), ("incident", None)):
        _write(c, "INSERT INTO events (run_id, time, kind, actor, reason, generation, data) VALUES (?,?,?,?,?,?,'{}')",
               (run_id, at, kind, "t", tag, generation))
    for state, ends in (("resolved", at), ("firing", None)):
        _write(c, "INSERT INTO alerts (run_id, rule, severity, state, summary, vals, diagnosis, actions, notify, "
               "starts_at, ends_at, fingerprint) VALUES (?,?,'warning',?,?,'{}','{}','[]',1,?,?,'f')",
               (run_id, f"{tag}-{state}", state, tag, at, ends))
    for state in ("delivered", "pending"):  # (webhook 999 does not exist: the worker never sends them)
        _write(c, "INSERT INTO outbox (webhook_id, created_at, body, state, next_attempt_at, last_error) "
               "VALUES (999,?,?,?,?,?)", (at, b"{}", state, at, f"{tag}-{state}"))
    _write(c, "INSERT INTO deliveries (outbox_id, webhook_id, attempt, time, duration_s, outcome) SELECT id, 999, 1, ?, "
           "0.1, 'ok' FROM outbox WHERE last_error=?", (at, f"{tag}-delivered"))
    for name, revoked, expires in (("revoked", at, None), ("expired", None, at), ("owner", at, None), ("live", None, None)):
        _write(c, "INSERT INTO tokens (token_hash, name, scopes, creator, created_at, expires_at, revoked_at) "
               "VALUES (?,?,'read','t',?,?,?)", (f"{tag}-{name}", f"{tag}-{name}", at - DAY, expires, revoked))
    _write(c, "INSERT INTO run_owners (run, token_hash, owned_at) VALUES (?,?,?)", (f"{tag}-owned", f"{tag}-owner", at))
    _write(c, "INSERT INTO idempotency (principal, key, request_hash, status, body, created_at) VALUES ('p',?,'h',200,?,?)",
           (tag, b"{}", at))
    _write(c, "INSERT INTO alertmanager_seen (fingerprint, starts_at, received_at) VALUES (?,'s',?)", (tag, at))


def test_the_hourly_prune_deletes_what_is_older_than_its_retention_and_keeps_the_rest(store_db: Any) -> None:
    now = [T0]
    settings = Settings(db=store_db, tick_s=60, report_retention_s=DAY, audit_retention_s=2 * DAY, rules_versions_kept=2)
    with TestClient(create_app(settings, clock=lambda: now[0])) as c:
        ctl = c.app.state.controller
        for run in ("gone", "live", "last"):
            register(c, run=run, world_size=1)
        assert c.post("/v1/runs/live/pause", json={"reason": "waits"}).status_code == 200  # (never removed)
        live = ctl.runs["live"].id
        generation = ctl.runs["live"].desired.generation
        _write(c, "UPDATE runs SET applied_generation=? WHERE id=?", (generation, live))  # (its ranks applied it)
        for run in ("gone", "last"):
            assert c.delete(f"/v1/runs/{run}", params={"force": "true"}).status_code == 200
        c.portal.call(ctl.tick)  # the start's prune: nothing is old yet
        _seed(c, OLD, "old", live)
        _seed(c, NEW, "new", live)
        for i in range(4):
            _write(c, "INSERT INTO rules_versions (text, source, actor, created_at) VALUES (?,'api','t',?)", (f"v{i}", OLD))
        first_version = _rows(c, "SELECT MIN(id) FROM rules_versions")[0][0]
        ctl.rules_store.meta["version"] = first_version  # the active rules: the oldest version
        before = _rows(c, "SELECT run_id, kind, reason FROM events ORDER BY id")
        now[0] = NOW
        c.portal.call(ctl.tick)
        # Events: every newer one; of the older, the live run's incident and its applied desired event.
        assert _rows(c, f"SELECT run_id, kind, reason FROM events WHERE time<{NOW - 2 * DAY} ORDER BY id") == [
            (live, "desired", "waits"), (live, "incident", "old")]
        assert [e for e in before if e[2] == "new"] == _rows(c, "SELECT run_id, kind, reason FROM events WHERE reason='new'")
        assert _rows(c, f"SELECT generation FROM events WHERE run_id={live} AND kind='desired' AND reason='waits'") == [
            (generation,)]
        assert _rows(c, "SELECT rule FROM alerts ORDER BY id") == [("old-firing",), ("new-resolved",), ("new-firing",)]
        assert _rows(c, "SELECT last_error FROM outbox ORDER BY id") == [("old-pending",), ("new-delivered",), ("new-pending",)]
        assert _rows(c, "SELECT o.last_error FROM deliveries d JOIN outbox o ON o.id=d.outbox_id") == [("new-delivered",)]
        assert _rows(c, "SELECT name FROM tokens ORDER BY id") == [
            ("old-owner",), ("old-live",), ("new-revoked",), ("new-expired",), ("new-owner",), ("new-live",)]
        # The deleted runs: gone's row goes with its events; last's stays (the highest run id).
        assert _rows(c, "SELECT run FROM deleted_runs") == [("last",)]
        assert _rows(c, "SELECT text FROM rules_versions ORDER BY id") == [("v0",), ("v2",), ("v3",)]
        assert _rows(c, "SELECT key FROM idempotency") == [("new",)]
        assert _rows(c, "SELECT fingerprint FROM alertmanager_seen") == [("new",)]
        register(c, run="gone", world_size=1)  # a new run's id is still above every deleted one's
        assert ctl.runs["gone"].id > _rows(c, "SELECT MAX(run_id) FROM deleted_runs")[0][0]


def test_the_prune_commits_at_most_the_batches_it_is_given(store_db: Any, monkeypatch: Any) -> None:
    """Ten old events in batches of three: two transactions delete six, the next two the last four
    (the step ends with a short batch), and each later step takes one transaction."""
    monkeypatch.setattr(retention, "PRUNE_ROWS", 3)
    store = open_store(store_db)
    try:
        store.write_now(lambda c: [c.execute("INSERT INTO events (run_id, time, kind, actor, reason, data) VALUES "
                                             "(1, ?, 'note', 't', '', '{}')", (T0 + i,)) for i in range(10)])
        left = lambda: store.read_now(lambda c: c.execute("SELECT COUNT(*) FROM events").fetchone()[0])  # noqa: E731

        async def main() -> list[tuple[int, int]]:
            store.start()
            pruner = Retention(Settings(db=store_db), store)
            pruner.start(NOW + 90 * DAY, active_rules=0)
            return [(await pruner.run(n), await asyncio.to_thread(left)) for n in (2, 2, 100, 100)]

        assert asyncio.run(main()) == [(2, 4), (2, 0), (8, 0), (0, 0)]
    finally:
        store.close()


def test_a_registered_run_keeps_its_old_incidents_and_desired_states_from_the_applied_one(store_db: Any) -> None:
    """A re-registration reads the desired state the ranks applied (generation 2, the run is at 3);
    a restart, the incidents. A run no longer registered (id 9) keeps none of them."""
    from trainguard.service import statements as sql

    store = open_store(store_db)
    try:
        def seed(c: Any) -> int:
            run_id = sql.insert_run(c, run="r", job="j", world_size=1, ranks=[], agent_version="t", config={}, now=T0)
            c.execute("UPDATE runs SET generation=3, applied_generation=2 WHERE id=?", (run_id,))
            for rid, kind, gen in [(run_id, "desired", g) for g in (1, 2, 3)] + [(run_id, "incident", 3), (run_id, "note", 3),
                                                                                  (9, "incident", 1), (9, "desired", 1)]:
                sql.insert_event(c, rid, now=T0, kind=kind, actor="t", reason="", generation=gen, data={})
            return run_id

        run_id = store.write_now(seed)

        async def main() -> None:
            store.start()
            pruner = Retention(Settings(db=store_db), store)
            pruner.start(T0 + 91 * DAY, active_rules=0)
            await pruner.run(100)

        asyncio.run(main())
        kept = store.read_now(lambda c: [tuple(r) for r in c.execute("SELECT run_id, kind, generation FROM events ORDER BY id")])
        assert kept == [(run_id, "desired", 2), (run_id, "desired", 3), (run_id, "incident", 3)]
    finally:
        store.close()


@pytest.mark.parametrize("audit", [DAY, 6 * DAY])
def test_an_audit_retention_shorter_than_the_reports_is_refused(audit: float, tmp_path: Any) -> None:
    with pytest.raises(ValueError, match=f"audit_retention_s \\({audit:g}\\) must be at least report_retention_s "
                                         "\\(604800\\)"):
        Settings(db=tmp_path / "tg.db", audit_retention_s=audit)


def test_a_deleted_webhooks_row_goes_once_its_deletion_is_older_than_the_audit_retention(store_db: Any) -> None:
    """Deleted at OLD: gone, unless a pending message names it or it has the highest id; deleted at
    NEW: kept; deleted before schema version 16 (no time of deletion): stamped at the first prune,
    gone at the first prune after the audit retention from then; never one in use."""
    now = [OLD]
    settings = Settings(db=store_db, tick_s=60, report_retention_s=DAY, audit_retention_s=2 * DAY)
    with TestClient(create_app(settings, clock=lambda: now[0])) as c:
        ctl = c.app.state.controller
        ids = {name: c.post("/v1/webhooks", json={"url": f"http://127.0.0.1:9/{name}"}).json()["id"]
               for name in ("old", "waited-on", "new", "unstamped", "in-use", "highest")}
        for name in ("old", "waited-on", "unstamped", "highest"):
            assert c.delete(f"/v1/webhooks/{ids[name]}").status_code == 204
        _write(c, "UPDATE webhooks SET deleted_at=NULL WHERE id=?", (ids["unstamped"],))
        _write(c, "INSERT INTO outbox (webhook_id, created_at, body, state, next_attempt_at) VALUES (?,?,?,'pending',?)",
               (ids["waited-on"], OLD, b"{}", NOW + 365 * DAY))  # (a message left pending: never sent in this test)
        now[0] = NEW
        assert c.delete(f"/v1/webhooks/{ids['new']}").status_code == 204
        now[0] = NOW
        c.portal.call(ctl.tick)
        kept = ["waited-on", "new", "unstamped", "in-use", "highest"]
        assert _rows(c, "SELECT id, deleted_at FROM webhooks ORDER BY id") == [
            (ids["waited-on"], OLD), (ids["new"], NEW), (ids["unstamped"], NOW), (ids["in-use"], None), (ids["highest"], OLD)]
        assert [w["id"] for w in c.get("/v1/webhooks").json()] == [ids["in-use"]]
        now[0] = NOW + 2 * DAY + 3600.0
        c.portal.call(ctl.tick)
        kept.remove("new"), kept.remove("unstamped")
        assert _rows(c, "SELECT id FROM webhooks ORDER BY id") == [(ids[name],) for name in kept]
        assert c.post("/v1/webhooks", json={"url": "http://127.0.0.1:9/next"}).json()["id"] == ids["highest"] + 1
