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

PostgreSQL (``--db postgresql://...``) is the other backend: :mod:`service.store_postgres`, the
same migrations and the same group commit (:class:`GroupCommitStore`), chosen by :func:`open_store`.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import os
import sqlite3
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar


__all__ = ["Store", "StoreError", "MIGRATIONS", "GroupCommitStore", "open_store", "is_database_url"]

log = logging.getLogger("trainguard.store")
T = TypeVar("T")
#: Receives the outcome of an operation whose caller stopped waiting: (True, result) or (False, error).
Orphaned = Callable[[bool, Any], None]

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
)

def _is_busy(e: sqlite3.OperationalError) -> bool:
    return getattr(e, "sqlite_errorcode", None) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED) or "locked" in str(e)


class StoreError(RuntimeError):
    """The database could not be written (the caller should answer 503)."""


def is_database_url(db: str | Path) -> bool:
    """True for a PostgreSQL URL (``postgresql://...`` or ``postgres://...``); anything else is a
    SQLite file."""
    return isinstance(db, str) and db.startswith(("postgresql://", "postgres://"))


def open_store(db: str | Path, *, busy_timeout_ms: int = 5000) -> "GroupCommitStore":
    """The store ``db`` names: PostgreSQL for a ``postgresql://`` URL (the ``postgres`` extra),
    else a SQLite file."""
    if is_database_url(db):
        try:
            from trainguard.service.store_postgres import PostgresStore
        except ImportError as e:
            raise StoreError(f"a postgresql:// database needs the driver: pip install 'trainguard[postgres]' ({e})") from e
        return PostgresStore(str(db), busy_timeout_ms=busy_timeout_ms)
    return Store(db, busy_timeout_ms=busy_timeout_ms)


def shown_db(db: str | Path) -> str:
    """``db`` as it may be printed or logged: a URL without its password."""
    if not is_database_url(db):
        return str(db)
    parts = urllib.parse.urlsplit(str(db))
    if parts.password is None:
        return str(db)
    netloc = parts.netloc.rsplit("@", 1)
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{parts.username}:***@{netloc[-1]}"))


Batch = list[tuple[Callable[[Any], Any], bool]]


class GroupCommitStore(abc.ABC):
    """What every backend shares: the queue of operations, the group commit at the end of the
    event loop's turn (or in a worker thread), and the hand-back of each outcome to its caller.

    A backend provides ``_commit(batch, wait=...)`` (one transaction, an outcome per operation;
    ``None`` with ``wait=False``: commit it off the event loop instead), ``_commit_waiting``
    (the same in a worker thread), ``read_now``, ``write_now``, ``start`` and ``close``.
    """

    busy_timeout_ms: int
    """How long a write waits for a lock another connection holds before it fails."""
    needs_lease = False
    """Whether other controllers may share this database, so that one must hold its writer lease
    (:meth:`take_lease`) before it serves."""

    def _init_queue(self) -> None:
        self._started = False
        self._closed = False
        self._pending: list[tuple[Any, asyncio.Future[Any], bool, Orphaned | None]] = []
        #: A batch is being committed in a worker thread (the write lock was held elsewhere):
        #: later submissions queue behind it, in order, while the event loop keeps serving.
        self._offloaded = False
        self.failed: BaseException | None = None
        self.commits = 0
        #: Why the last commit failed; ``None`` after a successful one (readiness reads it).
        self.write_error: str | None = None
        self._readers_lock = threading.Lock()
        # Reads in flight on worker threads: close() waits for them before closing the reader
        # connections (a request cancelled mid-read leaves its thread running the read).
        self._active_reads = 0
        self._reads_idle = threading.Condition(self._readers_lock)

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        """Count a read in flight (refused once the store is closed)."""
        with self._readers_lock:
            if self._closed:
                raise StoreError("the store is closed")
            self._active_reads += 1
        try:
            yield
        finally:
            with self._reads_idle:
                self._active_reads -= 1
                self._reads_idle.notify_all()

    def _close_reads(self, deadline: float) -> bool:
        """Refuse new reads; wait (until ``deadline``, monotonic) for those in flight. False: some
        still run (their connections must be left open)."""
        with self._reads_idle:
            self._closed = True
            if self._reads_idle.wait_for(lambda: self._active_reads == 0, max(0.0, deadline - time.monotonic())):
                return True
            log.warning("%d reads still running at close: their connections are left to the garbage collector",
                        self._active_reads)
            return False

    @abc.abstractmethod
    def _commit(self, batch: Batch, *, wait: bool = True) -> list[tuple[bool, Any]] | None:
        """Run ``batch`` in one transaction: an outcome per operation, or ``None`` (only with
        ``wait=False``) when it must be committed in a worker thread instead."""

    @abc.abstractmethod
    def _commit_waiting(self, batch: Batch) -> list[tuple[bool, Any]]:
        """:meth:`_commit` in a worker thread, waiting up to ``busy_timeout_ms`` for locks."""

    @abc.abstractmethod
    def read_now(self, op: Callable[[Any], T]) -> T:
        """Run a read-only ``op`` on a reader connection of this thread."""

    @abc.abstractmethod
    def write_now(self, op: Callable[[Any], T]) -> T:
        """Run ``op`` in its own transaction on the caller's thread (only before :meth:`start`)."""

    @abc.abstractmethod
    def start(self) -> None:
        """Start writing from the event loop."""

    def take_lease(self) -> int | None:
        """Become the one controller writing this database (PostgreSQL: wait for its writer lease,
        whose fencing token every write then checks). A SQLite file needs none: its lock admits one
        writer at a time, and a controller's file is its own."""
        return None

    @abc.abstractmethod
    def close(self, timeout: float = 10.0) -> None:
        """Commit what is queued (its callers get their outcome) and close every connection."""

    async def read(self, op: Callable[[Any], T]) -> T:
        """Run a read-only ``op`` in a worker thread (never blocks the event loop)."""
        return await asyncio.to_thread(self.read_now, op)

    def _commit_pending_now(self) -> None:
        """Commit what is queued, on the caller's thread (closing): its callers get their outcome."""
        if self._pending:
            batch, self._pending = self._pending, []
            self._settle(batch, self._commit_waiting([(op, single) for op, _fut, single, _orphaned in batch]))

    @property
    def alive(self) -> bool:
        return self._started and not self._closed and self.failed is None

    def submit(self, op: Callable[[Any], T], *, single_statement: bool = False,
               orphaned: Orphaned | None = None) -> asyncio.Future[T]:
        """Queue ``op`` for the next group commit; the future resolves after the commit.

        Every operation submitted during one turn of the event loop is committed in one
        transaction at the end of that turn, on the loop's thread: in WAL mode with
        ``synchronous=NORMAL`` a commit appends to the WAL without fsync (~0.1 ms), which costs
        less than handing work to a thread and back (a GIL hand-off per batch measured ~1 ms).
        The fsyncs happen in checkpoints, run by a separate thread. Each operation runs in a
        savepoint so that a failing one fails alone; an operation that executes exactly one
        statement may say so (``single_statement``) and skip the savepoint, since SQLite undoes
        a failed statement by itself.

        A queued operation runs even if its future is cancelled (the caller went away):
        ``orphaned(ok, result_or_error)`` then receives its outcome after the commit.

        An operation acts only through the connection it is given and returns what it made:
        PostgreSQL may run it twice (a batch whose pipeline failed is rolled back and run again
        with a savepoint per operation, :mod:`service.store_postgres`).
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        if not self.alive:
            fut.set_exception(StoreError(f"the database writer is not running: {self.failed!r}"))
            return fut
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.append((op, fut, single_statement, orphaned))
        return fut

    def _flush(self) -> None:
        if self._offloaded:
            return  # the worker's completion flushes what queued meanwhile
        batch, self._pending = self._pending, []
        if not batch:
            return
        results = self._commit([(op, single) for op, _fut, single, _orphaned in batch], wait=False)
        if results is None:  # the write lock is held elsewhere: wait for it off the event loop
            self._offloaded = True
            loop = asyncio.get_running_loop()
            work = loop.run_in_executor(None, self._commit_waiting, [(op, single) for op, _fut, single, _orphaned in batch])
            work.add_done_callback(lambda f: self._offloaded_done(batch, f))
            return
        self._resolve(batch, results)

    def _offloaded_done(self, batch: list[tuple[Any, asyncio.Future[Any], bool, Orphaned | None]],
                        work: asyncio.Future[list[tuple[bool, Any]]]) -> None:
        self._offloaded = False
        try:
            results = work.result()
        except BaseException as e:  # noqa: BLE001 - the executor itself failed: every caller gets a 503
            results = [(False, StoreError(f"database commit failed: {e!r}"))] * len(batch)
        self._resolve(batch, results)
        if self._pending:
            asyncio.get_running_loop().call_soon(self._flush)

    def _resolve(self, batch: list[tuple[Any, asyncio.Future[Any], bool, Orphaned | None]],
                 results: list[tuple[bool, Any]]) -> None:
        # Successes resolve in submission order (their events are published in id order);
        # failures after them, newest first, so that the callers take back their in-memory
        # changes in the reverse order of making them (see service.transaction).
        failed = []
        for (_op, fut, _single, orphaned), (ok, value) in zip(batch, results):
            if not ok:
                failed.append((fut, orphaned, value))
            elif not fut.done():
                fut.set_result(value)
            elif orphaned is not None:
                orphaned(True, value)
        for fut, orphaned, error in reversed(failed):
            if not fut.done():
                fut.set_exception(error)
            elif orphaned is not None:
                orphaned(False, error)

    def _settle(self, batch: list[tuple[Any, asyncio.Future[Any], bool, Orphaned | None]],
                results: list[tuple[bool, Any]]) -> None:
        """:meth:`_resolve` from any thread: at once on the futures' loop, else through it (a
        closed loop has nobody left to wait for them)."""
        loop = batch[0][1].get_loop()
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._resolve(batch, results)
        elif not loop.is_closed():
            loop.call_soon_threadsafe(self._resolve, batch, results)


class Store(GroupCommitStore):
    """SQLite in WAL mode: one writer thread with group commit, per-thread readers."""

    def __init__(self, path: str | Path, *, busy_timeout_ms: int = 5000) -> None:
        self.path = Path(path)
        self.busy_timeout_ms = busy_timeout_ms
        if str(path) == ":memory:":
            raise ValueError("the store needs a file (readers and the writer share it)")
        self._init_queue()
        self._conn = self._connect(readonly=False)
        self._lock = threading.RLock()  # the writer connection is used by one caller at a time
        self._stop = threading.Event()
        self._checkpointer: threading.Thread | None = None
        self.checkpoint_every_s = 1.0
        self._local = threading.local()
        self._readers: list[sqlite3.Connection] = []
        self._migrate()

    # -- connections -------------------------------------------------------------------------
    def _connect(self, *, readonly: bool) -> sqlite3.Connection:
        if readonly:
            conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, check_same_thread=False, isolation_level=None)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Owner-only: the file holds webhook secrets (and SQLite gives the -wal and -shm files
            # the database file's permissions).
            os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
            conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute(f"PRAGMA busy_timeout={int(self.busy_timeout_ms)}")
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
        with self._reading():
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

    # -- the writer ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start writing from the event loop, and the checkpointer thread."""
        if self._started:
            return
        self._conn.execute("PRAGMA wal_autocheckpoint=0")  # checkpoints (which fsync) run in their own thread
        # On the loop's thread the writer never waits for a lock: a batch that finds the write
        # lock taken (another process, a backup, an operator's sqlite3 shell) goes to a worker
        # thread that waits up to busy_timeout_ms, so every other route keeps answering meanwhile.
        self._conn.execute("PRAGMA busy_timeout=0")
        self._started = True
        self._checkpointer = threading.Thread(target=self._checkpoint_loop, name="trainguard-wal-checkpoint", daemon=True)
        self._checkpointer.start()

    def _commit_waiting(self, batch: list[tuple[Callable[[sqlite3.Connection], Any], bool]]) -> list[tuple[bool, Any]]:
        """:meth:`_commit` in a worker thread, waiting up to ``busy_timeout_ms`` for the write lock."""
        with self._lock:
            self._conn.execute(f"PRAGMA busy_timeout={int(self.busy_timeout_ms)}")
            try:
                results = self._commit(batch, wait=True)
            finally:
                self._conn.execute("PRAGMA busy_timeout=0")
        assert results is not None
        return results

    def _commit(self, batch: list[tuple[Callable[[sqlite3.Connection], Any], bool]], *,
                wait: bool = True) -> list[tuple[bool, Any]] | None:
        """Run ``batch`` in one transaction. With ``wait=False`` (the event loop's thread, busy
        timeout 0) answer ``None`` at once when another connection holds the write lock."""
        conn = self._conn
        results: list[tuple[bool, Any]] = []
        with self._lock:
            try:
                try:
                    conn.execute("BEGIN IMMEDIATE")
                except sqlite3.OperationalError as e:
                    if not wait and _is_busy(e):
                        return None
                    raise
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
                self.write_error = None
            except Exception as e:  # the commit itself failed (disk full, I/O error, lock wait timed out)
                log.exception("database commit failed")
                self.write_error = f"{type(e).__name__}: {e}"
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
        """Commit what is queued (its callers get their outcome), checkpoint, and close every
        connection (bounded by ``timeout``)."""
        if self._closed:
            return
        self._commit_pending_now()
        deadline = time.monotonic() + timeout
        with self._readers_lock:
            self._closed = True
        self._stop.set()
        if self._checkpointer is not None:
            self._checkpointer.join(timeout)
        # never close a connection another thread is reading with (bounded by the timeout)
        idle = self._close_reads(deadline)
        with self._readers_lock:
            for conn in self._readers if idle else ():
                try:
                    conn.close()
                except sqlite3.Error:
                    pass
            self._readers.clear()
        try:
            self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error as e:
            log.warning("final WAL checkpoint failed: %s", e)
        self._conn.close()
