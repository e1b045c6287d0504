"""The controller's database schema, one SQL script per version: :data:`MIGRATIONS`.

Written in SQLite's dialect; :class:`~service.store.Store` runs each script in one transaction and
records the version in ``PRAGMA user_version``, and :mod:`service.store_postgres` runs the same
scripts through its :class:`~service.postgres_sql.Dialect` (the version in a row of
``trainguard_schema``). A version, once released, never changes: a change of the schema (a table, a
column, or a field of the desired state's stored JSON) is a new version at the end, which an older
controller refuses.
"""

from __future__ import annotations

import logging

from trainguard.service.group_commit import StoreError

__all__ = ["MIGRATIONS", "check_version"]

log = logging.getLogger("trainguard.store")

# The columns of the reports table (frozen: schema versions 1 and 2 both create exactly these).
_REPORT_COLUMNS = """
        run_id INTEGER NOT NULL,
        seq INTEGER NOT NULL,
        step_first INTEGER NOT NULL,
        step_last INTEGER NOT NULL,
        time REAL NOT NULL,
        received REAL NOT NULL,
        applied_generation INTEGER NOT NULL,
        vals TEXT NOT NULL,
        ranks_mask INTEGER NOT NULL,
        ranks BLOB,
        PRIMARY KEY (run_id, seq)
"""

MIGRATIONS: tuple[str, ...] = (
    # 1: initial schema
    """
    CREATE TABLE runs (
        id INTEGER PRIMARY KEY,
        run TEXT NOT NULL UNIQUE,
        job TEXT NOT NULL,
        world_size INTEGER NOT NULL,
        ranks TEXT NOT NULL,
        agent_version TEXT NOT NULL,
        config TEXT NOT NULL,
        registered_at REAL NOT NULL,
        generation INTEGER NOT NULL DEFAULT 0,
        paused INTEGER NOT NULL DEFAULT 0,
        lr_scale REAL NOT NULL DEFAULT 1.0,
        checkpoint_seq INTEGER NOT NULL DEFAULT 0,
        stop INTEGER NOT NULL DEFAULT 0,
        reason TEXT NOT NULL DEFAULT '',
        applied_generation INTEGER NOT NULL DEFAULT 0,
        applied_step INTEGER,
        applied_at REAL
    );
    CREATE INDEX runs_job ON runs(job);
    CREATE TABLE reports (""" + _REPORT_COLUMNS + """) WITHOUT ROWID;
    CREATE INDEX reports_received ON reports(received);
    CREATE TABLE alerts (
        id INTEGER PRIMARY KEY,
        run_id INTEGER NOT NULL,
        rule TEXT NOT NULL,
        severity TEXT NOT NULL,
        state TEXT NOT NULL CHECK (state IN ('firing', 'resolved')),
        summary TEXT NOT NULL,
        vals TEXT NOT NULL,
        diagnosis TEXT NOT NULL,
        actions TEXT NOT NULL,
        generation INTEGER,
        notify INTEGER NOT NULL,
        starts_at REAL NOT NULL,
        ends_at REAL,
        fingerprint TEXT NOT NULL
    );
    CREATE INDEX alerts_run_state ON alerts(run_id, state);
    CREATE INDEX alerts_state ON alerts(state, id);
    CREATE TABLE events (
        id INTEGER PRIMARY KEY,
        run_id INTEGER NOT NULL,
        time REAL NOT NULL,
        kind TEXT NOT NULL,
        actor TEXT NOT NULL,
        reason TEXT NOT NULL,
        generation INTEGER,
        data TEXT NOT NULL
    );
    CREATE INDEX events_run ON events(run_id, id);
    CREATE TABLE webhooks (
        id INTEGER PRIMARY KEY,
        url TEXT NOT NULL,
        format TEXT NOT NULL,
        secret TEXT NOT NULL,
        min_severity TEXT NOT NULL,
        send_resolved INTEGER NOT NULL,
        created_at REAL NOT NULL,
        deleted INTEGER NOT NULL DEFAULT 0
    );
    CREATE TABLE outbox (
        id INTEGER PRIMARY KEY,
        webhook_id INTEGER NOT NULL,
        alert_id INTEGER,
        created_at REAL NOT NULL,
        body BLOB NOT NULL,
        state TEXT NOT NULL CHECK (state IN ('pending', 'delivered', 'failed', 'cancelled')),
        attempts INTEGER NOT NULL DEFAULT 0,
        next_attempt_at REAL NOT NULL,
        last_error TEXT
    );
    CREATE INDEX outbox_due ON outbox(state, next_attempt_at);
    CREATE TABLE deliveries (
        id INTEGER PRIMARY KEY,
        outbox_id INTEGER NOT NULL,
        webhook_id INTEGER NOT NULL,
        attempt INTEGER NOT NULL,
        time REAL NOT NULL,
        status_code INTEGER,
        error TEXT,
        duration_s REAL NOT NULL,
        outcome TEXT NOT NULL
    );
    CREATE INDEX deliveries_webhook ON deliveries(webhook_id, id);
    CREATE TABLE idempotency (
        principal TEXT NOT NULL,
        key TEXT NOT NULL,
        request_hash TEXT NOT NULL,
        status INTEGER NOT NULL,
        body BLOB NOT NULL,
        created_at REAL NOT NULL,
        PRIMARY KEY (principal, key)
    );
    CREATE TABLE alertmanager_seen (
        fingerprint TEXT NOT NULL,
        starts_at TEXT NOT NULL,
        received_at REAL NOT NULL,
        PRIMARY KEY (fingerprint, starts_at)
    );
    CREATE TABLE rules_versions (
        id INTEGER PRIMARY KEY,
        text TEXT NOT NULL,
        source TEXT NOT NULL,
        actor TEXT NOT NULL,
        created_at REAL NOT NULL
    );
    CREATE TABLE agent_bindings (
        token_hash TEXT PRIMARY KEY,
        run TEXT NOT NULL,
        bound_at REAL NOT NULL
    );
    """,
    # 2: reports in an ordinary rowid table. A report row is ~3.5 KB (values JSON + per-rank
    # vectors); in a WITHOUT ROWID table such rows live in the primary-key b-tree and spill into
    # overflow pages, which made an insert cost ~2-3x more (measured 35-56 vs 11-27 us).
    """
    CREATE TABLE reports_v2 (""" + _REPORT_COLUMNS + """);
    INSERT INTO reports_v2 (run_id, seq, step_first, step_last, time, received, applied_generation, vals, ranks_mask, ranks)
        SELECT run_id, seq, step_first, step_last, time, received, applied_generation, vals, ranks_mask, ranks FROM reports ORDER BY run_id, seq;
    DROP TABLE reports;
    ALTER TABLE reports_v2 RENAME TO reports;
    CREATE INDEX reports_received ON reports(received);
    """,
    # 3: run lifecycle. A run that finished (its agent said so at close) is not expected to report;
    # re-registering it clears these. ``resumed_at``: when the run was last unpaused, from which
    # the absence rules count silence (as from a registration).
    """
    ALTER TABLE runs ADD COLUMN finished_at REAL;
    ALTER TABLE runs ADD COLUMN finished_step INTEGER;
    ALTER TABLE runs ADD COLUMN finish_reason TEXT;
    ALTER TABLE runs ADD COLUMN resumed_at REAL;
    """,
    # 4: the number of gradient accumulation steps a command set (0: the run's own) and the rule
    # the LR follows it by.
    """
    ALTER TABLE runs ADD COLUMN accumulation_steps INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE runs ADD COLUMN accumulation_lr_rule TEXT NOT NULL DEFAULT 'none';
    """,
    # 5: tokens created at runtime (POST /v1/tokens), kept as SHA-256 digests with their scopes,
    # job pattern, creator and expiry; a revoked one keeps its row (who revoked it, when). The
    # owner of each run registered with such a token.
    """
    CREATE TABLE tokens (
        id INTEGER PRIMARY KEY,
        token_hash TEXT NOT NULL UNIQUE,
        name TEXT NOT NULL,
        scopes TEXT NOT NULL,
        job_pattern TEXT,
        creator TEXT NOT NULL,
        created_at REAL NOT NULL,
        expires_at REAL,
        revoked_at REAL,
        revoked_by TEXT
    );
    CREATE TABLE run_owners (
        run TEXT PRIMARY KEY,
        token_hash TEXT NOT NULL,
        owned_at REAL NOT NULL
    );
    """,
    # 6: rollback in the desired state (absolute, like checkpoint_seq).
    """
    ALTER TABLE runs ADD COLUMN rollback_seq INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE runs ADD COLUMN rollback_step INTEGER NOT NULL DEFAULT 0;
    """,
    # 7: diagnostic requests of the desired state: a memory trace, a gradient recompute check.
    """
    ALTER TABLE runs ADD COLUMN memory_trace_seq INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE runs ADD COLUMN verify_seq INTEGER NOT NULL DEFAULT 0;
    """,
    # 8: the data skip of the desired state (the step up to which every rank skips its optimizer steps).
    """
    ALTER TABLE runs ADD COLUMN data_skip_until INTEGER NOT NULL DEFAULT 0;
    """,
    # 9: the exit status a stopped run's processes should end with (a hardware fault's stop).
    """
    ALTER TABLE runs ADD COLUMN stop_exit_code INTEGER NOT NULL DEFAULT 0;
    """,
    # 10: the desired state as one JSON value (``DesiredState``, whose fields the command registry
    # declares): a new command adds no column. ``generation`` is still written beside it; the
    # columns of versions 1-9 are read only for a run whose ``desired`` is NULL (written before).
    """
    ALTER TABLE runs ADD COLUMN desired TEXT;
    """,
    # 11: what a start-up reads per run, each a range scan of an index (``service/startup.py``):
    # a run's incident events (the run's other events are skipped by the index, not read), and
    # the alerts that fired within the rules' cooldowns (not a scan of every alert ever raised).
    # A run's newest reports already are one: the (run_id, seq) primary key.
    """
    CREATE INDEX events_run_kind ON events(run_id, kind, id);
    CREATE INDEX alerts_starts ON alerts(starts_at);
    """,
    # 12: how a report's per-rank vectors are stored (``service/rank_store.py``): 0, the float64
    # rows of versions 1-11 (394 KB a report at 4,096 ranks; read as written); 1, a compact record
    # per vector (what the rules read of an older report: a few KB whatever the world size).
    """
    ALTER TABLE reports ADD COLUMN ranks_format INTEGER NOT NULL DEFAULT 0;
    """,
    # 13: the desired state's data_skip_from (a field of the ``desired`` JSON, no column; no SQL).
    # The version makes a controller of version 12 refuse the database: it reads every desired
    # state without the fields it does not know and writes it back without them (a data skip of
    # steps 25-30 would become one from the restored step to 30). So a field the stored desired
    # state gains is a new version (tests/service/test_service_store.py names each version's fields).
    "",
    # 14: deleted runs (``service/run_removal.py``): a run deleted by an operator or expired is
    # removed from ``runs`` and named here, so that its audit events and alerts, which are kept,
    # still name their run; ``reports_left`` while its reports are being deleted, in batches;
    # ``last_incident``, its highest incident id (incident ids go on after it at a restart). A new
    # run's id is above every id here (SQLite would reuse a deleted highest id).
    """
    CREATE TABLE deleted_runs (
        run_id INTEGER NOT NULL PRIMARY KEY,
        run TEXT NOT NULL,
        job TEXT NOT NULL,
        registered_at REAL NOT NULL,
        deleted_at REAL NOT NULL,
        last_incident INTEGER NOT NULL DEFAULT 0,
        reports_left INTEGER NOT NULL DEFAULT 1
    );
    CREATE INDEX deleted_runs_run ON deleted_runs(run);
    CREATE INDEX deleted_runs_reports_left ON deleted_runs(reports_left, run_id);
    """,
    # 15: retention (``service/retention.py``): what the hourly prune deletes once older than its
    # retention, each found by an index in batches (audit events and resolved alerts by time, webhook
    # messages by creation and their delivery attempts by message, deleted runs by deletion, the
    # idempotency and Alertmanager keys by time, a token still owning a run by its digest); and
    # ``room_probe``, the row /readyz writes and deletes while the disk was found full.
    """
    CREATE INDEX events_time ON events(time);
    CREATE INDEX alerts_ended ON alerts(ends_at);
    CREATE INDEX outbox_created ON outbox(created_at);
    CREATE INDEX deliveries_outbox ON deliveries(outbox_id);
    CREATE INDEX deleted_runs_deleted ON deleted_runs(deleted_at);
    CREATE INDEX idempotency_created ON idempotency(created_at);
    CREATE INDEX alertmanager_seen_received ON alertmanager_seen(received_at);
    CREATE INDEX run_owners_token ON run_owners(token_hash);
    CREATE TABLE room_probe (
        id INTEGER PRIMARY KEY,
        pad BLOB NOT NULL
    );
    """,
    # 16: when a webhook was deleted (``service/retention.py`` deletes its row once that is older
    # than the audit retention and no pending message names it). A webhook deleted before this
    # version has none: the prune stamps it with the time it first sees it.
    """
    ALTER TABLE webhooks ADD COLUMN deleted_at REAL;
    """,
)


def check_version(database: object, version: int, newest: int) -> None:
    """Before a controller of schema version ``newest`` migrates ``database`` from ``version``:
    ``StoreError`` when the database is newer; a warning naming both versions when it is older and
    not new (a warning: the log shows nothing less before the server runs, and a large database
    takes a while)."""
    if version > newest:
        raise StoreError(f"{database} has schema version {version}, newer than this controller ({newest})")
    if 0 < version < newest:
        log.warning("migrating %s from schema version %d to %d", database, version, newest)
