"""How long the controller keeps what it writes besides reports, and the hourly prune that deletes
the rest (:class:`Retention`, run by :mod:`service.absence_ticker` after the reports' prune).

- Audit events, resolved alerts, webhook messages that are no longer pending (with their delivery
  attempts), and revoked or expired tokens: kept ``TRAINGUARD_AUDIT_RETENTION_S`` (90 days, at
  least the report retention) after their time, end, creation, revocation or expiry. A registered
  run keeps, whatever their age, the events it may read back: its incidents (a restart) and its
  ``desired`` events from the generation its ranks applied on (a re-registration). A firing alert and a pending message are never deleted, nor a
  token that still owns a run.
- A deleted webhook's row (its URL and secret): deleted once its deletion is older than the audit
  retention and no pending message names it; the row of the highest webhook id stays (a new
  webhook's id goes on above it).
- A deleted run's row (``deleted_runs``, which names the run for its events and alerts): deleted
  once it is older than the audit retention and nothing names it any more; the row of the highest
  run id and of the highest incident id stay (a new run's id and incident ids go on above them).
- Rules versions: the newest ``TRAINGUARD_RULES_VERSIONS_KEPT`` (100), and the active one.
- Idempotency keys and the Alertmanager alerts acted on: :data:`KEYS_KEPT_S` (7 days) after their
  last sight (Alertmanager sends a firing alert again every ``repeat_interval``, 4 hours by
  default, each repeat within it refreshing the key, so a repeat never acts twice).

Each step deletes at most :data:`PRUNE_ROWS` rows a transaction, through an index (schema 15);
:meth:`Retention.run` commits at most the transactions a tick leaves it.
"""

from __future__ import annotations

import sqlite3
from typing import Callable

from trainguard.service.config import Settings
from trainguard.service.group_commit import GroupCommitStore
from trainguard.service.operator_commands import KEYS_KEPT_S

__all__ = ["Retention", "KEYS_KEPT_S", "PRUNE_ROWS", "prune_events", "prune_alerts", "prune_messages", "prune_webhooks",
           "prune_deleted_runs", "prune_tokens", "prune_rules_versions", "prune_idempotency", "prune_alertmanager_seen"]

#: Rows deleted per transaction by each step (webhook messages: a tenth, each with its attempts).
PRUNE_ROWS = 1000
MESSAGES_PER_BATCH = PRUNE_ROWS // 10


def prune_events(conn: sqlite3.Connection, before: float, limit: int) -> int:
    """Delete up to ``limit`` of the oldest audit events older than ``before``, except a registered
    run's incidents (a restart reads them) and its ``desired`` events from the generation its ranks
    applied on (a re-registration reads the applied one)."""
    return conn.execute(
        "DELETE FROM events WHERE id IN (SELECT e.id FROM events e LEFT JOIN runs r ON r.id = e.run_id WHERE e.time<? "
        "AND (r.id IS NULL OR NOT (e.kind='incident' OR (e.kind='desired' AND e.generation>=r.applied_generation))) "
        "ORDER BY e.time LIMIT ?)", (before, limit)).rowcount


def prune_alerts(conn: sqlite3.Connection, before: float, limit: int) -> int:
    """Delete up to ``limit`` of the alerts that resolved before ``before`` (a firing alert has no
    ``ends_at``: never deleted)."""
    return conn.execute("DELETE FROM alerts WHERE id IN (SELECT id FROM alerts WHERE ends_at<? ORDER BY ends_at LIMIT ?)",
                        (before, limit)).rowcount


def prune_messages(conn: sqlite3.Connection, before: float, limit: int) -> int:
    """Delete up to ``limit`` webhook messages created before ``before`` that are no longer pending,
    with their delivery attempts; the number of messages deleted."""
    ids = [r[0] for r in conn.execute("SELECT id FROM outbox WHERE created_at<? AND state<>'pending' "
                                      "ORDER BY created_at LIMIT ?", (before, limit))]
    if ids:
        marks = ",".join("?" * len(ids))
        conn.execute(f"DELETE FROM deliveries WHERE outbox_id IN ({marks})", ids)
        conn.execute(f"DELETE FROM outbox WHERE id IN ({marks})", ids)
    return len(ids)


def prune_webhooks(conn: sqlite3.Connection, now: float, before: float, limit: int) -> int:
    """Delete up to ``limit`` rows of webhooks deleted before ``before`` that no pending message
    names, except the row of the highest id (SQLite would give a new webhook that id, and the
    deleted one's delivery attempts with it). A webhook deleted before schema version 16 has no
    time of deletion: it is given ``now``."""
    conn.execute("UPDATE webhooks SET deleted_at=? WHERE deleted=1 AND deleted_at IS NULL", (now,))
    return conn.execute(
        "DELETE FROM webhooks WHERE id IN (SELECT w.id FROM webhooks w WHERE w.deleted=1 AND w.deleted_at<? "
        "AND w.id<(SELECT MAX(id) FROM webhooks) "
        "AND NOT EXISTS (SELECT 1 FROM outbox o WHERE o.state='pending' AND o.webhook_id=w.id) "
        "ORDER BY w.id LIMIT ?)", (before, limit)).rowcount


def prune_deleted_runs(conn: sqlite3.Connection, before: float, limit: int) -> int:
    """Delete up to ``limit`` rows of runs deleted before ``before`` whose reports are gone and that
    no event or alert names, except the rows of the highest run id and the highest incident id
    (found by the time of deletion: the unary ``+`` keeps SQLite off the other indexes)."""
    return conn.execute(
        "DELETE FROM deleted_runs WHERE run_id IN (SELECT d.run_id FROM deleted_runs d WHERE d.deleted_at<? "
        "AND +d.reports_left=0 AND NOT EXISTS (SELECT 1 FROM events e WHERE e.run_id=d.run_id) "
        "AND NOT EXISTS (SELECT 1 FROM alerts a WHERE a.run_id=d.run_id) "
        "AND +d.run_id<(SELECT MAX(run_id) FROM deleted_runs) "
        "AND (d.last_incident=0 OR d.last_incident<(SELECT MAX(last_incident) FROM deleted_runs)) "
        "ORDER BY d.deleted_at LIMIT ?)", (before, limit)).rowcount


def prune_tokens(conn: sqlite3.Connection, before: float, limit: int) -> int:
    """Delete up to ``limit`` tokens revoked or expired before ``before`` that own no run."""
    return conn.execute(
        "DELETE FROM tokens WHERE id IN (SELECT t.id FROM tokens t WHERE (t.revoked_at<? OR t.expires_at<?) "
        "AND NOT EXISTS (SELECT 1 FROM run_owners o WHERE o.token_hash=t.token_hash) ORDER BY t.id LIMIT ?)",
        (before, before, limit)).rowcount


def prune_rules_versions(conn: sqlite3.Connection, keep: int, active: int, limit: int) -> int:
    """Delete up to ``limit`` of the oldest rules versions beyond the newest ``keep``, never the
    ``active`` one."""
    return conn.execute(
        "DELETE FROM rules_versions WHERE id IN (SELECT id FROM rules_versions WHERE id<(SELECT id FROM rules_versions "
        "ORDER BY id DESC LIMIT 1 OFFSET ?) AND id<>? ORDER BY id LIMIT ?)", (keep - 1, active, limit)).rowcount


def prune_idempotency(conn: sqlite3.Connection, before: float, limit: int) -> int:
    """Delete up to ``limit`` idempotency keys created before ``before``."""
    return conn.execute("DELETE FROM idempotency WHERE (principal, key) IN (SELECT principal, key FROM idempotency "
                        "WHERE created_at<? ORDER BY created_at LIMIT ?)", (before, limit)).rowcount


def prune_alertmanager_seen(conn: sqlite3.Connection, before: float, limit: int) -> int:
    """Delete up to ``limit`` Alertmanager alerts last seen before ``before``."""
    return conn.execute("DELETE FROM alertmanager_seen WHERE (fingerprint, starts_at) IN (SELECT fingerprint, starts_at "
                        "FROM alertmanager_seen WHERE received_at<? ORDER BY received_at LIMIT ?)", (before, limit)).rowcount


class Retention:
    """One round of the prune at a time: its steps in order, each repeated until a transaction
    deletes fewer rows than its batch."""

    def __init__(self, settings: Settings, store: GroupCommitStore) -> None:
        self.settings = settings
        self.store = store
        self.steps: list[tuple[Callable[[sqlite3.Connection], int], int]] = []
        """The steps of the round under way (the first, under way), each with its batch size."""

    def start(self, now: float, active_rules: int) -> None:
        """Begin a round at ``now`` (a round not finished starts over); ``active_rules``: the id of
        the rules version in force."""
        audit, keys, kept = now - self.settings.audit_retention_s, now - KEYS_KEPT_S, self.settings.rules_versions_kept
        self.steps = [
            (lambda c: prune_events(c, audit, PRUNE_ROWS), PRUNE_ROWS),
            (lambda c: prune_alerts(c, audit, PRUNE_ROWS), PRUNE_ROWS),
            (lambda c: prune_messages(c, audit, MESSAGES_PER_BATCH), MESSAGES_PER_BATCH),
            (lambda c: prune_webhooks(c, now, audit, PRUNE_ROWS), PRUNE_ROWS),
            (lambda c: prune_deleted_runs(c, audit, PRUNE_ROWS), PRUNE_ROWS),
            (lambda c: prune_tokens(c, audit, PRUNE_ROWS), PRUNE_ROWS),
            (lambda c: prune_rules_versions(c, kept, active_rules, PRUNE_ROWS), PRUNE_ROWS),
            (lambda c: prune_idempotency(c, keys, PRUNE_ROWS), PRUNE_ROWS),
            (lambda c: prune_alertmanager_seen(c, keys, PRUNE_ROWS), PRUNE_ROWS),
        ]

    async def run(self, transactions: int) -> int:
        """Commit up to ``transactions`` batches of the round; the number committed."""
        done = 0
        while self.steps and done < transactions:
            step, batch = self.steps[0]
            done += 1
            if await self.store.submit(step) < batch:
                self.steps.pop(0)
        return done
