"""Every SQL statement of the controller: functions of the connection that the store's writer (in
a transaction) or one of its readers hands them. Only :mod:`service.store`, the controller's
transactions (:mod:`service.transaction`) and the webhook worker call these; routes go through the
controller.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

import numpy as np
import pydantic_core

from trainguard.service import rank_store

_JSON = json.JSONEncoder(separators=(",", ":"))  # one encoder: json.dumps builds one per call with these options


def dumps_json(value: Any) -> str:
    """JSON text for a column; NaN/Inf written as Python's NaN/Infinity tokens (json reads them)."""
    return _JSON.encode(value)


def dumps_values(values: dict[str, float]) -> str:
    """A report's values as JSON text, like :func:`dumps_json` (NaN/Infinity tokens) but ~10x
    faster: the ingest path writes one per report."""
    return pydantic_core.to_json(values, inf_nan_mode="constants").decode()


def insert_run(conn: sqlite3.Connection, *, run: str, job: str, world_size: int, ranks: list[dict[str, Any]],
               agent_version: str, config: dict[str, Any], now: float, run_id: int | None = None) -> int:
    """A new run's row; its id ``run_id`` (``deletion_statements.next_run_id``), else the database's next."""
    cur = conn.execute(
        "INSERT INTO runs (id, run, job, world_size, ranks, agent_version, config, registered_at) VALUES"
        " (COALESCE(?, (SELECT COALESCE(MAX(id), 0) + 1 FROM runs)),?,?,?,?,?,?,?)",
        (run_id, run, job, world_size, dumps_json(ranks), agent_version, dumps_json(config), now),
    )
    return int(cur.lastrowid)


def update_run_registration(conn: sqlite3.Connection, run_id: int, *, world_size: int, ranks: list[dict[str, Any]],
                            agent_version: str, config: dict[str, Any], now: float) -> None:
    conn.execute(
        "UPDATE runs SET world_size=?, ranks=?, agent_version=?, config=?, registered_at=?,"
        " finished_at=NULL, finished_step=NULL, finish_reason=NULL WHERE id=?",
        (world_size, dumps_json(ranks), agent_version, dumps_json(config), now, run_id),
    )


def update_desired(conn: sqlite3.Connection, run_id: int, d: Any) -> None:
    """Store the desired state ``d`` (a ``DesiredState``) as its JSON, its generation beside it."""
    conn.execute("UPDATE runs SET desired=?, generation=? WHERE id=?", (d.model_dump_json(), d.generation, run_id))


def update_finished(conn: sqlite3.Connection, run_id: int, *, now: float, step: int, reason: str) -> None:
    conn.execute("UPDATE runs SET finished_at=?, finished_step=?, finish_reason=? WHERE id=?", (now, step, reason, run_id))


def update_resumed(conn: sqlite3.Connection, run_id: int, now: float) -> None:
    conn.execute("UPDATE runs SET resumed_at=? WHERE id=?", (now, run_id))


def update_applied(conn: sqlite3.Connection, run_id: int, generation: int, step: int, now: float) -> None:
    conn.execute("UPDATE runs SET applied_generation=?, applied_step=?, applied_at=? WHERE id=?", (generation, step, now, run_id))


def insert_report(conn: sqlite3.Connection, run_id: int, seq: int, report: Any, received: float,
                  ranks: dict[str, np.ndarray], vector_names: tuple[str, ...]) -> None:
    mask, blob = rank_store.encode(ranks, vector_names)  # a few KB whatever the world size
    conn.execute(
        "INSERT INTO reports (run_id, seq, step_first, step_last, time, received, applied_generation, vals, ranks_mask,"
        " ranks, ranks_format) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
        (run_id, seq, report.step_first, report.step_last, report.time, received, report.applied_generation,
         dumps_values(report.values), mask, blob, rank_store.FORMAT_RECORDS),
    )


def recent_reports(conn: sqlite3.Connection, run_id: int, limit: int) -> list[sqlite3.Row]:
    rows = conn.execute(
        "SELECT seq, step_first, step_last, time, received, applied_generation, vals, ranks_mask, ranks, ranks_format"
        " FROM reports WHERE run_id=? ORDER BY seq DESC LIMIT ?", (run_id, limit),
    ).fetchall()
    rows.reverse()
    return rows


def decode_ranks(row: sqlite3.Row, world_size: int, vector_names: tuple[str, ...]) -> rank_store.StoredRanks:
    """A stored report's per-rank vectors (:func:`service.rank_store.decode`: rows of schema
    version 12 on hold compact records, older ones float64 rows; both decode). Bit ``i`` of the
    mask is ``vector_names[i]`` under every layout version (the layout is append-only:
    ``trainguard.protocol.rank_values``), so a row of an older layout decodes as written; bits
    beyond ``vector_names`` (a newer controller's row) are vectors unknown here and skipped."""
    return rank_store.decode(row["ranks_mask"], row["ranks"], row["ranks_format"], world_size, vector_names)


def published_desired(conn: sqlite3.Connection, run_id: int, generation: int) -> dict[str, Any] | None:
    """The desired state (as its stored JSON object) that published ``generation`` of a run, from
    its ``desired`` audit event; None when none is stored."""
    row = conn.execute("SELECT data FROM events WHERE run_id = ? AND kind = 'desired' AND generation = ? "
                       "ORDER BY id DESC LIMIT 1", (run_id, generation)).fetchone()
    desired = json.loads(row[0]).get("desired") if row is not None else None
    return desired if isinstance(desired, dict) else None


def recent_incidents(conn: sqlite3.Connection, run_id: int, limit: int) -> list[dict[str, Any]]:
    """The last state of each of a run's newest ``limit`` incidents, oldest first, from its
    ``incident`` audit events (each carries the whole incident as it was after that change)."""
    latest: dict[int, dict[str, Any]] = {}
    rows = conn.execute("SELECT data FROM events WHERE run_id = ? AND kind = 'incident' ORDER BY id DESC LIMIT ?",
                        (run_id, 16 * limit))
    for (data,) in rows:
        incident = json.loads(data).get("incident")
        if isinstance(incident, dict) and isinstance(incident.get("id"), int):
            latest.setdefault(incident["id"], incident)  # newest first: the first seen is the last state
    return [latest[i] for i in sorted(latest)[-limit:]]


def insert_event(conn: sqlite3.Connection, run_id: int, *, now: float, kind: str, actor: str, reason: str,
                 generation: int | None, data: dict[str, Any]) -> int:
    cur = conn.execute(
        "INSERT INTO events (run_id, time, kind, actor, reason, generation, data) VALUES (?,?,?,?,?,?,?)",
        (run_id, now, kind, actor, reason, generation, dumps_json(data)),
    )
    return int(cur.lastrowid)


def insert_alert(conn: sqlite3.Connection, run_id: int, *, rule: str, severity: str, summary: str, values: dict[str, Any],
                 diagnosis: dict[str, Any], actions: list[dict[str, Any]], generation: int | None, notify: bool,
                 now: float, fingerprint: str) -> int:
    cur = conn.execute(
        "INSERT INTO alerts (run_id, rule, severity, state, summary, vals, diagnosis, actions, generation, notify, starts_at, fingerprint)"
        " VALUES (?,?,?,'firing',?,?,?,?,?,?,?,?)",
        (run_id, rule, severity, summary, dumps_json(values), dumps_json(diagnosis), dumps_json(actions), generation,
         int(notify), now, fingerprint),
    )
    return int(cur.lastrowid)


def resolve_alerts(conn: sqlite3.Connection, run_id: int, rule: str, now: float) -> list[int]:
    ids = [r[0] for r in conn.execute("SELECT id FROM alerts WHERE run_id=? AND rule=? AND state='firing'", (run_id, rule))]
    conn.execute("UPDATE alerts SET state='resolved', ends_at=? WHERE run_id=? AND rule=? AND state='firing'", (now, run_id, rule))
    return ids


#: The run (name, job) of an alert or audit event: a deleted run's too (its alerts and events are kept).
_RUN_OF = " LEFT JOIN runs r ON r.id = {t}.run_id LEFT JOIN deleted_runs d ON d.run_id = {t}.run_id"


def _named(conn: sqlite3.Connection, t: str, run: str) -> tuple[str, list[int]]:
    """The condition on ``t.run_id`` selecting the rows of each run named ``run`` (deleted ones too), and its ids."""
    ids = [r[0] for r in conn.execute("SELECT id FROM runs WHERE run=? UNION ALL SELECT run_id FROM deleted_runs WHERE run=?", (run, run))]
    return f"{t}.run_id IN ({','.join('?' * len(ids)) or 'NULL'})", ids
_ALERT_SELECT = (
    "SELECT a.id, COALESCE(r.run, d.run) AS run, COALESCE(r.job, d.job) AS job, a.rule, a.severity, a.state, a.summary,"
    " a.vals, a.diagnosis, a.actions, a.generation, a.notify, a.starts_at, a.ends_at, a.fingerprint FROM alerts a"
) + _RUN_OF.format(t="a")


def alert_dict(row: sqlite3.Row) -> dict[str, Any]:
    d = dict(row)
    d["values"] = json.loads(d.pop("vals"))
    d["diagnosis"] = json.loads(d["diagnosis"])
    d["actions"] = json.loads(d["actions"])
    d["notify"] = bool(d["notify"])
    return d


def get_alert(conn: sqlite3.Connection, alert_id: int) -> dict[str, Any]:
    return alert_dict(conn.execute(_ALERT_SELECT + " WHERE a.id=?", (alert_id,)).fetchone())


def list_alerts(conn: sqlite3.Connection, *, state: str | None, run: str | None, limit: int, before: int | None) -> list[dict[str, Any]]:
    where, args = [], []
    if state:
        where.append("a.state=?")
        args.append(state)
    if run:
        cond, ids = _named(conn, "a", run)
        where.append(cond)
        args += ids
    if before:
        where.append("a.id<?")
        args.append(before)
    sql = _ALERT_SELECT + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY a.id DESC LIMIT ?"
    return [alert_dict(r) for r in conn.execute(sql, (*args, limit))]


def firing_alerts(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    return [alert_dict(r) for r in conn.execute(_ALERT_SELECT + " WHERE a.state='firing' ORDER BY a.id")]


def recent_fire_times(conn: sqlite3.Connection, since: float) -> list[tuple[int, str, float]]:
    return [tuple(r) for r in conn.execute("SELECT run_id, rule, starts_at FROM alerts WHERE starts_at>=?", (since,))]


def event_dict(row: sqlite3.Row) -> dict[str, Any]:
    d = dict(row)
    d["data"] = json.loads(d["data"])
    return d


_EVENT_SELECT = ("SELECT e.id, COALESCE(r.run, d.run) AS run, COALESCE(r.job, d.job) AS job, e.time, e.kind, e.actor,"
                 " e.reason, e.generation, e.data FROM events e" + _RUN_OF.format(t="e"))


def list_events(conn: sqlite3.Connection, *, run: str | None, after: int, limit: int) -> list[dict[str, Any]]:
    if run is None:
        rows = conn.execute(_EVENT_SELECT + " WHERE e.id>? ORDER BY e.id LIMIT ?", (after, limit))
    else:
        cond, ids = _named(conn, "e", run)
        rows = conn.execute(_EVENT_SELECT + f" WHERE {cond} AND e.id>? ORDER BY e.id LIMIT ?", (*ids, after, limit))
    return [event_dict(r) for r in rows]


def list_events_before(conn: sqlite3.Connection, *, run: str | None, before: int | None, limit: int) -> list[dict[str, Any]]:
    """Audit events with ids below ``before`` (from the newest when ``None``), newest first."""
    where, args = [], []
    if run is not None:
        cond, ids = _named(conn, "e", run)
        where.append(cond)
        args += ids
    if before is not None:
        where.append("e.id<?")
        args.append(before)
    sql = _EVENT_SELECT + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY e.id DESC LIMIT ?"
    return [event_dict(r) for r in conn.execute(sql, (*args, limit))]


def get_events(conn: sqlite3.Connection, ids: list[int]) -> list[dict[str, Any]]:
    if not ids:
        return []
    marks = ",".join("?" * len(ids))
    return [event_dict(r) for r in conn.execute(_EVENT_SELECT + f" WHERE e.id IN ({marks}) ORDER BY e.id", ids)]


def all_runs(conn: sqlite3.Connection) -> list[sqlite3.Row]:
    """Every run's row (no report: each run's newest ones are :func:`recent_reports`)."""
    return conn.execute("SELECT * FROM runs ORDER BY id").fetchall()


def count_runs(conn: sqlite3.Connection) -> int:
    return int(conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0])


# webhooks
def insert_webhook(conn: sqlite3.Connection, *, url: str, format: str, secret: str, min_severity: str, send_resolved: bool, now: float) -> int:
    cur = conn.execute(
        "INSERT INTO webhooks (url, format, secret, min_severity, send_resolved, created_at) VALUES (?,?,?,?,?,?)",
        (url, format, secret, min_severity, int(send_resolved), now),
    )
    return int(cur.lastrowid)


def delete_webhook(conn: sqlite3.Connection, webhook_id: int, now: float) -> bool:
    cur = conn.execute("UPDATE webhooks SET deleted=1, deleted_at=? WHERE id=? AND deleted=0", (now, webhook_id))
    conn.execute("UPDATE outbox SET state='cancelled' WHERE webhook_id=? AND state='pending'", (webhook_id,))
    return cur.rowcount > 0


def active_webhooks(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    return [dict(r) for r in conn.execute("SELECT * FROM webhooks WHERE deleted=0 ORDER BY id")]


def get_webhook(conn: sqlite3.Connection, webhook_id: int) -> dict[str, Any] | None:
    row = conn.execute("SELECT * FROM webhooks WHERE id=? AND deleted=0", (webhook_id,)).fetchone()
    return dict(row) if row else None


def insert_outbox(conn: sqlite3.Connection, *, webhook_id: int, alert_id: int | None, body: bytes, now: float) -> int:
    cur = conn.execute(
        "INSERT INTO outbox (webhook_id, alert_id, created_at, body, state, next_attempt_at) VALUES (?,?,?,?,'pending',?)",
        (webhook_id, alert_id, now, body, now),
    )
    return int(cur.lastrowid)


def due_outbox(conn: sqlite3.Connection, now: float, limit: int) -> list[dict[str, Any]]:
    return [dict(r) for r in conn.execute(
        "SELECT o.id, o.webhook_id, o.body, o.attempts, w.url, w.format, w.secret FROM outbox o"
        " JOIN webhooks w ON w.id = o.webhook_id WHERE o.state='pending' AND o.next_attempt_at<=? ORDER BY o.next_attempt_at, o.id LIMIT ?",
        (now, limit),
    )]


def next_outbox_time(conn: sqlite3.Connection) -> float | None:
    row = conn.execute("SELECT MIN(next_attempt_at) FROM outbox WHERE state='pending'").fetchone()
    return row[0]


def pending_outbox_count(conn: sqlite3.Connection) -> int:
    return int(conn.execute("SELECT COUNT(*) FROM outbox WHERE state='pending'").fetchone()[0])


def record_delivery(conn: sqlite3.Connection, *, outbox_id: int, webhook_id: int, attempt: int, now: float,
                    status_code: int | None, error: str | None, duration_s: float, outcome: str, next_attempt_at: float | None) -> None:
    conn.execute(
        "INSERT INTO deliveries (outbox_id, webhook_id, attempt, time, status_code, error, duration_s, outcome) VALUES (?,?,?,?,?,?,?,?)",
        (outbox_id, webhook_id, attempt, now, status_code, error, duration_s, outcome),
    )
    state = {"delivered": "delivered", "failed": "failed", "retry": "pending"}[outcome]
    # A message cancelled while its attempt was on its way (its webhook deleted) stays cancelled.
    conn.execute(
        "UPDATE outbox SET state=?, attempts=?, next_attempt_at=COALESCE(?, next_attempt_at), last_error=? "
        "WHERE id=? AND state='pending'",
        (state, attempt, next_attempt_at, error, outbox_id),
    )


def list_deliveries(conn: sqlite3.Connection, webhook_id: int, limit: int) -> list[dict[str, Any]]:
    return [dict(r) for r in conn.execute(
        "SELECT d.id, d.outbox_id, o.alert_id, d.attempt, d.time, d.status_code, d.error, d.duration_s, d.outcome"
        " FROM deliveries d JOIN outbox o ON o.id = d.outbox_id WHERE d.webhook_id=? ORDER BY d.id DESC LIMIT ?",
        (webhook_id, limit),
    )]


# idempotency, alertmanager dedupe, rules, bindings
def get_idempotent(conn: sqlite3.Connection, principal: str, key: str) -> sqlite3.Row | None:
    return conn.execute("SELECT request_hash, status, body FROM idempotency WHERE principal=? AND key=?", (principal, key)).fetchone()


def put_idempotent(conn: sqlite3.Connection, principal: str, key: str, request_hash: str, status: int, body: bytes, now: float) -> None:
    conn.execute(
        "INSERT INTO idempotency (principal, key, request_hash, status, body, created_at) VALUES (?,?,?,?,?,?)",
        (principal, key, request_hash, status, body, now),
    )


def mark_alertmanager_seen(conn: sqlite3.Connection, fingerprint: str, starts_at: str, now: float) -> bool:
    cur = conn.execute("INSERT OR IGNORE INTO alertmanager_seen (fingerprint, starts_at, received_at) VALUES (?,?,?)", (fingerprint, starts_at, now))
    return cur.rowcount > 0


def refresh_alertmanager_seen(conn: sqlite3.Connection, fingerprint: str, starts_at: str, now: float) -> None:
    """An alert acted on was seen again at ``now`` (its retention counts from its last sight)."""
    conn.execute("UPDATE alertmanager_seen SET received_at=? WHERE fingerprint=? AND starts_at=?", (now, fingerprint, starts_at))


def alertmanager_seen(conn: sqlite3.Connection, since: float) -> list[tuple[str, str]]:
    return [tuple(r) for r in conn.execute("SELECT fingerprint, starts_at FROM alertmanager_seen WHERE received_at>=? ORDER BY received_at", (since,))]


def insert_rules_version(conn: sqlite3.Connection, text: str, source: str, actor: str, now: float) -> int:
    cur = conn.execute("INSERT INTO rules_versions (text, source, actor, created_at) VALUES (?,?,?,?)", (text, source, actor, now))
    return int(cur.lastrowid)


def latest_rules(conn: sqlite3.Connection) -> sqlite3.Row | None:
    return conn.execute("SELECT id, text, source, actor, created_at FROM rules_versions ORDER BY id DESC LIMIT 1").fetchone()


def bind_agent(conn: sqlite3.Connection, token_digest: str, run: str, now: float) -> None:
    conn.execute("INSERT OR IGNORE INTO agent_bindings (token_hash, run, bound_at) VALUES (?,?,?)", (token_digest, run, now))


def agent_bindings(conn: sqlite3.Connection) -> dict[str, str]:
    return {r[0]: r[1] for r in conn.execute("SELECT token_hash, run FROM agent_bindings")}


def own_run(conn: sqlite3.Connection, run: str, token_hash: str, now: float) -> None:
    conn.execute("INSERT OR IGNORE INTO run_owners (run, token_hash, owned_at) VALUES (?,?,?)", (run, token_hash, now))


def run_owners(conn: sqlite3.Connection) -> dict[str, str]:
    return {r[0]: r[1] for r in conn.execute("SELECT run, token_hash FROM run_owners")}
