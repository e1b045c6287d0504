"""The controller's persistence: one SQLite file in WAL mode, behind this module only.

Writes go through a single writer connection with group commit: callers on the event loop submit
operations (functions of a connection); at the end of the loop's turn every operation submitted
meanwhile runs in one transaction, each inside a savepoint so that one failing operation fails
alone, and the callers' futures resolve after the commit (see :meth:`Store.submit` for why this
runs on the loop's thread). WAL checkpoints run in a thread of their own. An alert, the desired-state change it causes, its
audit-log event and its webhook outbox rows are one operation, hence one transaction. Reads use
per-thread read-only connections (WAL lets them run beside the writer).

Durability: ``synchronous=NORMAL`` in WAL mode, so a committed transaction survives the death of
the process (SIGKILL); a power loss may lose the last transactions.

Schema versions live in ``PRAGMA user_version``; :data:`MIGRATIONS` brings any older file up to
date at start-up.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

import numpy as np
import pydantic_core

__all__ = ["Store", "StoreError", "MIGRATIONS"]

log = logging.getLogger("trainguard.store")
T = TypeVar("T")

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
)



class StoreError(RuntimeError):
    """The database could not be written (the caller should answer 503)."""


class Store:
    """SQLite in WAL mode: one writer thread with group commit, per-thread readers."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if str(path) == ":memory:":
            raise ValueError("the store needs a file (readers and the writer share it)")
        self._conn = self._connect(readonly=False)
        self._lock = threading.Lock()  # the writer connection is used by one caller at a time
        self._started = False
        self._closed = False
        self._stop = threading.Event()
        self._checkpointer: threading.Thread | None = None
        self.checkpoint_every_s = 1.0
        self._local = threading.local()
        self._readers: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()
        # Reads in flight on worker threads: close() waits for them before closing the reader
        # connections (a request cancelled mid-read leaves its thread running the read).
        self._active_reads = 0
        self._reads_idle = threading.Condition(self._readers_lock)
        self._pending: list[tuple[Any, asyncio.Future[Any], bool]] = []
        self.failed: BaseException | None = None
        self.commits = 0
        self._migrate()

    # -- connections -------------------------------------------------------------------------
    def _connect(self, *, readonly: bool) -> sqlite3.Connection:
        if readonly:
            conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, check_same_thread=False, isolation_level=None)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA busy_timeout=5000")
        conn.row_factory = sqlite3.Row
        return conn

    def _migrate(self) -> None:
        with self._lock:
            version = self._conn.execute("PRAGMA user_version").fetchone()[0]
            if version > len(MIGRATIONS):
                raise StoreError(f"{self.path} has schema version {version}, newer than this controller ({len(MIGRATIONS)})")
            for target in range(version + 1, len(MIGRATIONS) + 1):
                log.info("migrating %s to schema version %d", self.path, target)
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    for stmt in MIGRATIONS[target - 1].split(";"):
                        if stmt.strip():
                            self._conn.execute(stmt)
                    self._conn.execute(f"PRAGMA user_version={target}")
                    self._conn.execute("COMMIT")
                except BaseException:
                    self._conn.execute("ROLLBACK")
                    raise

    # -- synchronous use (start-up, tools) --------------------------------------------------------
    def write_now(self, op: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``op`` in its own transaction on the caller's thread (only before :meth:`start`)."""
        if self._started:
            raise RuntimeError("the event loop writes once started; use submit()")
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                result = op(self._conn)
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")
            return result

    def read_now(self, op: Callable[[sqlite3.Connection], T]) -> T:
        """Run a read-only ``op`` on this thread's reader connection."""
        with self._readers_lock:
            if self._closed:
                raise StoreError("the store is closed")
            self._active_reads += 1
        try:
            conn = getattr(self._local, "conn", None)
            if conn is None:
                conn = self._local.conn = self._connect(readonly=True)
                with self._readers_lock:
                    self._readers.append(conn)
            conn.execute("BEGIN")
            try:
                return op(conn)
            finally:
                conn.execute("COMMIT")
        finally:
            with self._reads_idle:
                self._active_reads -= 1
                self._reads_idle.notify_all()

    async def read(self, op: Callable[[sqlite3.Connection], T]) -> T:
        """Run a read-only ``op`` in a worker thread (never blocks the event loop)."""
        return await asyncio.to_thread(self.read_now, op)

    # -- the writer ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start writing from the event loop, and the checkpointer thread."""
        if self._started:
            return
        self._conn.execute("PRAGMA wal_autocheckpoint=0")  # checkpoints (which fsync) run in their own thread
        self._started = True
        self._checkpointer = threading.Thread(target=self._checkpoint_loop, name="trainguard-wal-checkpoint", daemon=True)
        self._checkpointer.start()

    @property
    def alive(self) -> bool:
        return self._started and not self._closed and self.failed is None

    def submit(self, op: Callable[[sqlite3.Connection], T], *, single_statement: bool = False) -> asyncio.Future[T]:
        """Queue ``op`` for the next group commit; the future resolves after the commit.

        Every operation submitted during one turn of the event loop is committed in one
        transaction at the end of that turn, on the loop's thread: in WAL mode with
        ``synchronous=NORMAL`` a commit appends to the WAL without fsync (~0.1 ms), which costs
        less than handing work to a thread and back (a GIL hand-off per batch measured ~1 ms).
        The fsyncs happen in checkpoints, run by a separate thread. Each operation runs in a
        savepoint so that a failing one fails alone; an operation that executes exactly one
        statement may say so (``single_statement``) and skip the savepoint, since SQLite undoes
        a failed statement by itself.
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        if not self.alive:
            fut.set_exception(StoreError(f"the database writer is not running: {self.failed!r}"))
            return fut
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.append((op, fut, single_statement))
        return fut

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        if not batch:
            return
        results = self._commit([(op, single) for op, _fut, single in batch])
        for (_op, fut, _single), (ok, value) in zip(batch, results):
            if fut.done():
                continue
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(value)

    def _commit(self, batch: list[tuple[Callable[[sqlite3.Connection], Any], bool]]) -> list[tuple[bool, Any]]:
        conn = self._conn
        results: list[tuple[bool, Any]] = []
        with self._lock:
            try:
                conn.execute("BEGIN IMMEDIATE")
                for op, single in batch:
                    if single:
                        try:
                            results.append((True, op(conn)))
                        except Exception as e:
                            results.append((False, e))
                        continue
                    conn.execute("SAVEPOINT op")
                    try:
                        results.append((True, op(conn)))
                        conn.execute("RELEASE op")
                    except Exception as e:  # one bad operation fails alone
                        conn.execute("ROLLBACK TO op")
                        conn.execute("RELEASE op")
                        results.append((False, e))
                conn.execute("COMMIT")
                self.commits += 1
            except Exception as e:  # the commit itself failed (disk full, I/O error)
                log.exception("database commit failed")
                try:
                    conn.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
                err = StoreError(f"database commit failed: {e}")
                results = [(False, err)] * len(batch)
        return results

    def _checkpoint_loop(self) -> None:
        conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        conn.execute("PRAGMA busy_timeout=5000")
        try:
            while not self._stop.wait(self.checkpoint_every_s):
                try:
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
                except sqlite3.Error as e:
                    log.warning("WAL checkpoint failed: %s", e)
        finally:
            conn.close()

    def close(self, timeout: float = 10.0) -> None:
        """Commit what is queued, checkpoint, and close every connection (bounded by ``timeout``)."""
        if self._closed:
            return
        if self._pending:
            results = self._commit([(op, single) for op, _fut, single in self._pending])
            self._pending = []
            del results
        deadline = time.monotonic() + timeout
        with self._readers_lock:
            self._closed = True
        self._stop.set()
        if self._checkpointer is not None:
            self._checkpointer.join(timeout)
        with self._reads_idle:
            # never close a connection another thread is reading with (bounded by the timeout)
            if self._reads_idle.wait_for(lambda: self._active_reads == 0, max(0.0, deadline - time.monotonic())):
                for conn in self._readers:
                    try:
                        conn.close()
                    except sqlite3.Error:
                        pass
            else:
                log.warning("%d reads still running at close: their connections are left to the garbage collector",
                            self._active_reads)
            self._readers.clear()
        try:
            self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error as e:
            log.warning("final WAL checkpoint failed: %s", e)
        self._conn.close()


# -- statements --------------------------------------------------------------------------------
# Every SQL statement of the controller lives below; each function takes the connection that the
# writer (or a reader) hands it.
_JSON = json.JSONEncoder(separators=(",", ":"))  # one encoder: json.dumps builds one per call with these options


def dumps_json(value: Any) -> str:
    """JSON text for a column; NaN/Inf written as Python's NaN/Infinity tokens (json reads them)."""
    return _JSON.encode(value)


def dumps_values(values: dict[str, float]) -> str:
    """A report's values as JSON text, like :func:`dumps_json` (NaN/Infinity tokens) but ~10x
    faster: the ingest path writes one per report."""
    return pydantic_core.to_json(values, inf_nan_mode="constants").decode()


def insert_run(conn: sqlite3.Connection, *, run: str, job: str, world_size: int, ranks: list[dict[str, Any]],
               agent_version: str, config: dict[str, Any], now: float) -> int:
    cur = conn.execute(
        "INSERT INTO runs (run, job, world_size, ranks, agent_version, config, registered_at) VALUES (?,?,?,?,?,?,?)",
        (run, job, world_size, dumps_json(ranks), agent_version, dumps_json(config), now),
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
    conn.execute(
        "UPDATE runs SET generation=?, paused=?, lr_scale=?, checkpoint_seq=?, stop=?, reason=?, accumulation_steps=?,"
        " accumulation_lr_rule=? WHERE id=?",
        (d.generation, int(d.paused), d.lr_scale, d.checkpoint_seq, int(d.stop), d.reason, d.accumulation_steps,
         d.accumulation_lr_rule, run_id),
    )


def update_finished(conn: sqlite3.Connection, run_id: int, *, now: float, step: int, reason: str) -> None:
    conn.execute("UPDATE runs SET finished_at=?, finished_step=?, finish_reason=? WHERE id=?", (now, step, reason, run_id))


def update_resumed(conn: sqlite3.Connection, run_id: int, now: float) -> None:
    conn.execute("UPDATE runs SET resumed_at=? WHERE id=?", (now, run_id))


def update_applied(conn: sqlite3.Connection, run_id: int, generation: int, step: int, now: float) -> None:
    conn.execute("UPDATE runs SET applied_generation=?, applied_step=?, applied_at=? WHERE id=?", (generation, step, now, run_id))


def insert_report(conn: sqlite3.Connection, run_id: int, seq: int, report: Any, received: float,
                  ranks: dict[str, np.ndarray], vector_names: tuple[str, ...]) -> None:
    mask, blob = 0, None
    if ranks:
        present = [i for i, name in enumerate(vector_names) if name in ranks]
        mask = sum(1 << i for i in present)
        blob = np.stack([ranks[vector_names[i]] for i in present]).tobytes()
    conn.execute(
        "INSERT INTO reports (run_id, seq, step_first, step_last, time, received, applied_generation, vals, ranks_mask, ranks)"
        " VALUES (?,?,?,?,?,?,?,?,?,?)",
        (run_id, seq, report.step_first, report.step_last, report.time, received, report.applied_generation,
         dumps_values(report.values), mask, blob),
    )


def recent_reports(conn: sqlite3.Connection, run_id: int, limit: int) -> list[sqlite3.Row]:
    rows = conn.execute(
        "SELECT seq, step_first, step_last, time, received, applied_generation, vals, ranks_mask, ranks FROM reports"
        " WHERE run_id=? ORDER BY seq DESC LIMIT ?", (run_id, limit),
    ).fetchall()
    rows.reverse()
    return rows


def decode_ranks(row: sqlite3.Row, world_size: int, vector_names: tuple[str, ...]) -> dict[str, np.ndarray]:
    mask, blob = row["ranks_mask"], row["ranks"]
    if not mask or blob is None:
        return {}
    present = [name for i, name in enumerate(vector_names) if mask >> i & 1]
    arr = np.frombuffer(blob, dtype=np.float64)
    if arr.size != len(present) * world_size:
        return {}  # recorded under another world size
    arr = arr.reshape(len(present), world_size)
    return {name: arr[i].copy() for i, name in enumerate(present)}


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


_ALERT_SELECT = (
    "SELECT a.id, r.run, r.job, a.rule, a.severity, a.state, a.summary, a.vals, a.diagnosis, a.actions, a.generation,"
    " a.notify, a.starts_at, a.ends_at, a.fingerprint FROM alerts a JOIN runs r ON r.id = a.run_id"
)


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
        where.append("r.run=?")
        args.append(run)
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


_EVENT_SELECT = "SELECT e.id, r.run, r.job, e.time, e.kind, e.actor, e.reason, e.generation, e.data FROM events e JOIN runs r ON r.id = e.run_id"


def list_events(conn: sqlite3.Connection, *, run: str | None, after: int, limit: int) -> list[dict[str, Any]]:
    if run is None:
        rows = conn.execute(_EVENT_SELECT + " WHERE e.id>? ORDER BY e.id LIMIT ?", (after, limit))
    else:
        rows = conn.execute(_EVENT_SELECT + " WHERE r.run=? AND e.id>? ORDER BY e.id LIMIT ?", (run, after, limit))
    return [event_dict(r) for r in rows]


def get_events(conn: sqlite3.Connection, ids: list[int]) -> list[dict[str, Any]]:
    if not ids:
        return []
    marks = ",".join("?" * len(ids))
    return [event_dict(r) for r in conn.execute(_EVENT_SELECT + f" WHERE e.id IN ({marks}) ORDER BY e.id", ids)]


def all_runs(conn: sqlite3.Connection) -> list[sqlite3.Row]:
    return conn.execute(
        "SELECT r.*, (SELECT MAX(received) FROM reports p WHERE p.run_id = r.id) AS last_report_at,"
        " (SELECT MAX(seq) FROM reports p WHERE p.run_id = r.id) AS last_seq FROM runs r ORDER BY r.id"
    ).fetchall()


# webhooks
def insert_webhook(conn: sqlite3.Connection, *, url: str, format: str, secret: str, min_severity: str, send_resolved: bool, now: float) -> int:
    cur = conn.execute(
        "INSERT INTO webhooks (url, format, secret, min_severity, send_resolved, created_at) VALUES (?,?,?,?,?,?)",
        (url, format, secret, min_severity, int(send_resolved), now),
    )
    return int(cur.lastrowid)


def delete_webhook(conn: sqlite3.Connection, webhook_id: int) -> bool:
    cur = conn.execute("UPDATE webhooks SET deleted=1 WHERE id=? AND deleted=0", (webhook_id,))
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
    conn.execute(
        "UPDATE outbox SET state=?, attempts=?, next_attempt_at=COALESCE(?, next_attempt_at), last_error=? WHERE id=?",
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


def alertmanager_seen(conn: sqlite3.Connection, since: float) -> list[tuple[str, str]]:
    return [tuple(r) for r in conn.execute("SELECT fingerprint, starts_at FROM alertmanager_seen WHERE received_at>=?", (since,))]


def insert_rules_version(conn: sqlite3.Connection, text: str, source: str, actor: str, now: float) -> int:
    cur = conn.execute("INSERT INTO rules_versions (text, source, actor, created_at) VALUES (?,?,?,?)", (text, source, actor, now))
    return int(cur.lastrowid)


def latest_rules(conn: sqlite3.Connection) -> sqlite3.Row | None:
    return conn.execute("SELECT id, text, source, actor, created_at FROM rules_versions ORDER BY id DESC LIMIT 1").fetchone()


def bind_agent(conn: sqlite3.Connection, token_digest: str, run: str, now: float) -> None:
    conn.execute("INSERT OR IGNORE INTO agent_bindings (token_hash, run, bound_at) VALUES (?,?,?)", (token_digest, run, now))


def agent_bindings(conn: sqlite3.Connection) -> dict[str, str]:
    return {r[0]: r[1] for r in conn.execute("SELECT token_hash, run FROM agent_bindings")}


def prune(conn: sqlite3.Connection, *, reports_before: float, keys_before: float) -> int:
    n = conn.execute("DELETE FROM reports WHERE received<?", (reports_before,)).rowcount
    conn.execute("DELETE FROM idempotency WHERE created_at<?", (keys_before,))
    conn.execute("DELETE FROM alertmanager_seen WHERE received_at<?", (keys_before,))
    return n
