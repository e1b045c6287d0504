"""The SQL that deletes what the controller no longer keeps (called by :mod:`service.absence_ticker`
and :mod:`service.run_removal`, through the store): reports older than the retention, and deleted
runs — the run's row moved to ``deleted_runs`` (its audit events and alerts are kept, and still
name it, for the audit retention: :mod:`service.retention`), its reports deleted in batches."""

from __future__ import annotations

import sqlite3

__all__ = ["prune_reports", "next_run_id", "delete_run", "purge_deleted_reports", "was_deleted",
           "last_deleted_incident"]


def prune_reports(conn: sqlite3.Connection, before: float, limit: int) -> int:
    """Delete the oldest ``limit`` reports received before ``before``; the number deleted."""
    return conn.execute("DELETE FROM reports WHERE (run_id, seq) IN (SELECT run_id, seq FROM reports WHERE received<? "
                        "ORDER BY received LIMIT ?)", (before, limit)).rowcount


def next_run_id(conn: sqlite3.Connection) -> int:
    """The id of a new run: above every run's, deleted ones' included (SQLite would give a new row
    the id of a deleted highest one, and the deleted run's events and alerts would become the new
    run's)."""
    row = conn.execute("SELECT MAX(id) FROM (SELECT MAX(id) AS id FROM runs UNION ALL "
                       "SELECT MAX(run_id) AS id FROM deleted_runs) AS ids").fetchone()
    return int(row[0] or 0) + 1


def delete_run(conn: sqlite3.Connection, run_id: int, *, now: float, last_incident: int) -> None:
    """Move run ``run_id`` from ``runs`` to ``deleted_runs`` (its reports to be deleted by
    :func:`purge_deleted_reports`), free its name of its owner token, resolve its firing alerts."""
    conn.execute("INSERT INTO deleted_runs (run_id, run, job, registered_at, deleted_at, last_incident) "
                 "SELECT id, run, job, registered_at, ?, ? FROM runs WHERE id=?", (now, last_incident, run_id))
    conn.execute("DELETE FROM run_owners WHERE run IN (SELECT run FROM runs WHERE id=?)", (run_id,))
    conn.execute("UPDATE alerts SET state='resolved', ends_at=? WHERE run_id=? AND state='firing'", (now, run_id))
    conn.execute("DELETE FROM runs WHERE id=?", (run_id,))


def purge_deleted_reports(conn: sqlite3.Connection, limit: int) -> bool:
    """Delete up to ``limit`` reports of the oldest deleted run that still has some; False when no
    deleted run has reports left."""
    row = conn.execute("SELECT run_id FROM deleted_runs WHERE reports_left=1 ORDER BY run_id LIMIT 1").fetchone()
    if row is None:
        return False
    run_id = row[0]
    deleted = conn.execute("DELETE FROM reports WHERE (run_id, seq) IN (SELECT run_id, seq FROM reports WHERE run_id=? "
                           "ORDER BY seq LIMIT ?)", (run_id, limit)).rowcount
    if deleted < limit:
        conn.execute("UPDATE deleted_runs SET reports_left=0 WHERE run_id=?", (run_id,))
    return True


def was_deleted(conn: sqlite3.Connection, run: str) -> bool:
    """Whether a run named ``run`` was deleted (its audit events are kept)."""
    return conn.execute("SELECT 1 FROM deleted_runs WHERE run=? LIMIT 1", (run,)).fetchone() is not None


def last_deleted_incident(conn: sqlite3.Connection) -> int:
    """The highest incident id of the deleted runs (0 when none had one)."""
    return int(conn.execute("SELECT COALESCE(MAX(last_incident), 0) FROM deleted_runs").fetchone()[0])
