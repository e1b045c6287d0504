"""The controller's persistence on PostgreSQL (``--db postgresql://...``; the ``postgres`` extra).

The same store as :class:`~service.store.Store`, behind the same interface: the same schema
versions (:data:`~service.store.MIGRATIONS`), the same statements (:mod:`service.statements`), the
same group commit (:class:`~service.store.GroupCommitStore`): every operation submitted in one
turn of the event loop is committed in one transaction, each inside a savepoint so that a failing
one fails alone, and the callers learn the outcome after the commit (a failed commit fails them
all, and the controller takes its in-memory changes back).

What differs from SQLite:

- The commit runs in a worker thread, never on the event loop: a PostgreSQL commit waits for the
  server's WAL flush (``synchronous_commit``: an acknowledged report survives the death of the
  controller, of the database server and of its machine's power). Operations submitted while one
  batch commits queue behind it and form the next batch.
- A batch goes to the server in one pipeline (its statements and COMMIT sent together, the
  answers awaited once), not a round trip per statement. When anything in it fails, the whole transaction is rolled back
  and the batch runs again with a savepoint per operation, so that the failing one fails alone;
  an operation may therefore run twice (it only writes through its connection), and an identity
  id taken by the rolled-back attempt is skipped.
- :class:`Dialect` (``service/postgres_sql.py``) turns the SQLite text of the migrations and statements into PostgreSQL's,
  in this one place: ``?`` placeholders, column types (``INTEGER`` is 64-bit, ``REAL`` is a
  double, ``BLOB`` is ``BYTEA``, ``INTEGER PRIMARY KEY`` an identity column), ``INSERT OR
  IGNORE``, and the id of an inserted row (``RETURNING id`` for ``cursor.lastrowid``).
- The schema version is a row of ``trainguard_schema``; migrations run in one transaction under
  an advisory lock, so two controllers starting together migrate once.
- Reads take a pooled connection (psycopg_pool) in a read-only REPEATABLE READ transaction: one
  snapshot per read, as a SQLite reader's transaction gives.
- A write that waits for a lock longer than ``busy_timeout_ms`` fails (``lock_timeout``), and a
  lost connection fails the batch: the callers get :class:`~service.store.StoreError` (503), and
  the next batch reconnects.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, Callable, TypeVar

import psycopg
import psycopg_pool

from trainguard.service.group_commit import Batch, GroupCommitStore, StoreError
from trainguard.service.migrations import MIGRATIONS, check_version
from trainguard.service.postgres_sql import Dialect, PgConnection, is_operational, row_factory
from trainguard.service.store import shown_db

__all__ = ["PostgresStore", "Dialect", "PgConnection"]

log = logging.getLogger("trainguard.store")
T = TypeVar("T")

#: pg_advisory_xact_lock key of the migrations (any constant shared by every controller).
_MIGRATION_LOCK = 0x7472_6775_6172_64  # "trguard"


#: Raises (SQLSTATE TG001) unless ``token`` is the writer lease's current token: the first statement
#: of every write transaction of a store that holds the lease. It share-locks the lease row, so a
#: successor's takeover waits for the transactions in flight and loads the state after them.
_FENCE_FUNCTION = """
CREATE OR REPLACE FUNCTION trainguard_fence(held BIGINT) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM trainguard_lease WHERE name = 'writer' AND token = held FOR SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'trainguard lease % lost: another controller writes this database', held USING ERRCODE = 'TG001';
    END IF;
END $$
"""
_FENCED = "TG001"


class PostgresStore(GroupCommitStore):
    """PostgreSQL: one writer connection committing in a worker thread with group commit, a pool
    of readers."""

    needs_lease = True

    def __init__(self, url: str, *, busy_timeout_ms: int = 5000, max_readers: int = 8, lease_s: float = 6.0) -> None:
        self.url = url
        self.path = shown_db(url)
        """What names this database in messages (the URL without its password)."""
        self.busy_timeout_ms = busy_timeout_ms
        self.pipelined = True
        """Send each batch in one pipeline first (see :meth:`_commit_pipelined`)."""
        self.retried_batches = 0
        """Batches whose pipeline failed and that were committed one savepoint per operation."""
        self.lease_s = lease_s
        """How long the writer lease lasts without a renewal (renewed every third of it)."""
        self.lease_token: int | None = None
        """The fencing token of the writer lease this store holds (``None``: it took none)."""
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._refused_newer = False  # the newer schema that keeps this controller from the lease was logged
        self._renewer: threading.Thread | None = None
        self._renewing = threading.Event()
        self._init_queue()
        self._lock = threading.RLock()  # the writer connection is used by one caller at a time
        self._conn: psycopg.Connection[Any] | None = None
        self._conn = self._writer()
        self._migrate()
        self._pool = psycopg_pool.ConnectionPool(
            url, min_size=1, max_size=max_readers, open=False, configure=self._configure_reader,
            check=psycopg_pool.ConnectionPool.check_connection, timeout=max(1.0, busy_timeout_ms / 1000),
            kwargs={"row_factory": row_factory, "application_name": "trainguard-read"}, name="trainguard-readers")
        try:
            self._pool.open(wait=True, timeout=10.0)
        except psycopg_pool.PoolTimeout as e:
            self._conn.close()
            raise StoreError(f"cannot open reader connections to {self.path}: {e}") from e

    # -- connections -------------------------------------------------------------------------
    def _writer(self) -> psycopg.Connection[Any]:
        """The writer connection, reconnected when the last one broke (server restart, network)."""
        if self._conn is not None and not self._conn.closed and not self._conn.broken:
            return self._conn
        if self._conn is not None:
            log.warning("reconnecting the database writer to %s", self.path)
            self._conn.close()
        try:
            conn = psycopg.connect(self.url, autocommit=True, row_factory=row_factory,
                                   application_name="trainguard-write", connect_timeout=10)
        except psycopg.Error as e:
            raise StoreError(f"cannot connect to {self.path}: {e}") from e
        # a write waiting for a lock held elsewhere gives up like SQLite's busy timeout
        conn.execute(f"SET lock_timeout = {int(self.busy_timeout_ms)}")
        self._conn = conn
        return conn

    @staticmethod
    def _configure_reader(conn: psycopg.Connection[Any]) -> None:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.read_only = True

    def _migrate(self) -> None:
        with self._lock:
            raw = self._writer()
            with raw.transaction():
                raw.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
                raw.execute("CREATE TABLE IF NOT EXISTS trainguard_schema (version INTEGER NOT NULL)")
                row = raw.execute("SELECT version FROM trainguard_schema").fetchone()
                if row is None:
                    raw.execute("INSERT INTO trainguard_schema (version) VALUES (0)")
                version = 0 if row is None else row[0]
                check_version(self.path, version, len(MIGRATIONS))
                for target in range(version + 1, len(MIGRATIONS) + 1):
                    for stmt in Dialect.ddl(MIGRATIONS[target - 1]):
                        raw.execute(stmt)
                    raw.execute("UPDATE trainguard_schema SET version = %s", (target,))
                # the writer's lease (PostgreSQL's own: SQLite has one writer per file by its lock)
                raw.execute("CREATE TABLE IF NOT EXISTS trainguard_lease (name TEXT PRIMARY KEY, holder TEXT NOT NULL, "
                            "token BIGINT NOT NULL, expires_at TIMESTAMPTZ NOT NULL)")
                raw.execute("INSERT INTO trainguard_lease VALUES ('writer', '', 0, '-infinity') ON CONFLICT DO NOTHING")
                raw.execute(_FENCE_FUNCTION)

    @property
    def schema_version(self) -> int:
        return int(self.read_now(lambda c: c.execute("SELECT version FROM trainguard_schema").fetchone()[0]))

    # -- synchronous use (start-up, tools) --------------------------------------------------------
    def write_now(self, op: Callable[[PgConnection], T]) -> T:
        """Run ``op`` in its own transaction on the caller's thread (only before :meth:`start`)."""
        if self._started:
            raise RuntimeError("the event loop writes once started; use submit()")
        with self._lock:
            raw = self._writer()
            with raw.transaction():
                self._fence(raw)
                return op(PgConnection(raw))

    def read_now(self, op: Callable[[PgConnection], T]) -> T:
        """Run a read-only ``op`` in one snapshot, on a pooled connection."""
        try:
            with self._reading(), self._pool.connection() as raw:
                return op(PgConnection(raw))
        except psycopg_pool.PoolClosed as e:
            raise StoreError("the store is closed") from e
        except psycopg_pool.PoolTimeout as e:
            raise StoreError(f"no reader connection to {self.path}: {e}") from e

    # -- the writer ----------------------------------------------------------------------------
    def start(self) -> None:
        self._started = True

    def _commit(self, batch: Batch, *, wait: bool = True) -> list[tuple[bool, Any]] | None:
        """Run ``batch`` in one transaction; with ``wait=False`` (the event loop) answer ``None``:
        a PostgreSQL commit always runs in a worker thread."""
        if not wait:
            return None
        results: list[tuple[bool, Any]] | None
        with self._lock:
            raw = None
            try:
                raw = self._writer()
                results = self._commit_pipelined(raw, batch) if self.pipelined else None
                if results is None:
                    results = self._commit_each(raw, batch)
                self.commits += 1
                self.write_error = None
            except Exception as e:  # the commit itself failed (connection lost, server down, a deferred check)
                if getattr(e, "sqlstate", None) == _FENCED:
                    self._deposed(e)
                log.exception("database commit failed")
                self.write_error = f"{type(e).__name__}: {e}"
                if raw is not None and not raw.broken and not raw.closed:
                    try:
                        raw.execute("ROLLBACK")
                    except psycopg.Error:
                        pass
                err = e if isinstance(e, StoreError) else StoreError(f"database commit failed: {e}")
                if err is not e:
                    err.__cause__ = e
                results = [(False, err)] * len(batch)
        return results

    def _commit_pipelined(self, raw: psycopg.Connection[Any], batch: Batch) -> list[tuple[bool, Any]] | None:
        """The whole batch and its COMMIT sent in one pipeline: the server's answers are awaited
        once, not once per statement (an operation that reads waits for what it reads). ``None``
        when anything failed: everything is rolled back, for :meth:`_commit_each` to find which
        operation it was."""
        conn = PgConnection(raw)
        results: list[tuple[bool, Any]] = []
        try:
            with raw.pipeline():
                raw.execute("BEGIN")
                self._fence(raw)
                for op, _single in batch:
                    results.append((True, op(conn)))
                raw.execute("COMMIT")
            return results
        except Exception:
            if raw.broken or raw.closed:
                raise
            raw.execute("ROLLBACK")
            self.retried_batches += 1
            return None

    def _commit_each(self, raw: psycopg.Connection[Any], batch: Batch) -> list[tuple[bool, Any]]:
        """The batch with one savepoint per operation, so that a failing one fails alone."""
        conn = PgConnection(raw)
        results: list[tuple[bool, Any]] = []
        # One round trip opens the next savepoint with what closes the last one.
        raw.execute("BEGIN")
        self._fence(raw)
        prefix = "SAVEPOINT op"
        for op, _single in batch:
            if prefix:
                raw.execute(prefix)
            try:
                results.append((True, op(conn)))
                prefix = "RELEASE op; SAVEPOINT op"
            except Exception as e:  # one bad operation fails alone
                if raw.broken:
                    raise
                raw.execute("ROLLBACK TO op")
                prefix = ""  # the savepoint stands again: the next operation reuses it
                if is_operational(e):
                    cause, e = e, StoreError(f"database write failed: {e}")
                    e.__cause__ = cause
                results.append((False, e))
        raw.execute("COMMIT")
        return results

    def _commit_waiting(self, batch: Batch) -> list[tuple[bool, Any]]:
        results = self._commit(batch, wait=True)
        assert results is not None
        return results

    # -- the writer lease ------------------------------------------------------------------------
    def take_lease(self, *, timeout: float | None = None, poll_s: float = 0.5) -> int:
        """Become the one controller writing this database: wait (up to ``timeout`` seconds,
        ``None``: as long as it takes) until the writer lease is free or has expired (its holder
        stopped renewing it: dead, or cut off from the database), take it with the next fencing
        token, and renew it from a thread of its own. Every write transaction then starts by
        checking that token (:data:`_FENCE_FUNCTION`), so a controller that lost the lease can never
        write again: its commits fail (503) and the store stops (:attr:`alive` false)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        waited = False
        with psycopg.connect(self.url, autocommit=True, application_name="trainguard-lease", connect_timeout=10) as conn:
            conn.execute(f"SET lock_timeout = {int(self.lease_s * 1000)}")  # a hung holder's transaction
            while True:
                try:  # never over a database a newer controller migrated since this one started
                    row = conn.execute(
                        "UPDATE trainguard_lease SET holder = %s, token = token + 1, expires_at = now() + make_interval(secs => %s)"
                        " WHERE name = 'writer' AND expires_at < now() AND (SELECT MAX(version) FROM trainguard_schema) <= %s"
                        " RETURNING token", (self.holder, self.lease_s, len(MIGRATIONS))).fetchone()
                except psycopg.errors.LockNotAvailable:
                    row = None  # the old holder's last transaction still runs: try again
                if row is not None:
                    break
                newer = self._newer_schema(conn)
                if newer and deadline is not None and time.monotonic() >= deadline:
                    raise StoreError(newer)
                if not waited:
                    holder = conn.execute("SELECT holder FROM trainguard_lease WHERE name = 'writer'").fetchone()[0]
                    log.info("standing by: %s holds the writer lease of %s", holder, self.path)
                    waited = True
                if deadline is not None and time.monotonic() >= deadline:
                    raise StoreError(f"another controller holds the writer lease of {self.path}")
                time.sleep(poll_s)
        self.lease_token = int(row[0])
        log.info("writer lease of %s taken (fencing token %d)", self.path, self.lease_token)
        self._renewer = threading.Thread(target=self._renew_loop, name="trainguard-lease", daemon=True)
        self._renewer.start()
        return self.lease_token

    def _newer_schema(self, conn: psycopg.Connection[Any]) -> str:
        """Why this controller may not take the lease: the database's schema is newer than its own
        (logged once); '' when it is not."""
        version = conn.execute("SELECT MAX(version) FROM trainguard_schema").fetchone()[0]
        if version <= len(MIGRATIONS):
            return ""
        reason = (f"{self.path} has schema version {version}, newer than this controller ({len(MIGRATIONS)}): a newer "
                  "controller migrated it since this one started, so this one stands by until it is stopped")
        if not self._refused_newer:
            self._refused_newer = True
            log.error("%s", reason)
        return reason

    def _fence(self, raw: psycopg.Connection[Any]) -> None:
        if self.lease_token is not None:
            raw.execute("SELECT trainguard_fence(%s)", (self.lease_token,))

    def _deposed(self, e: BaseException) -> None:
        if self.failed is None:
            log.error("this controller lost the writer lease of %s and writes no more: %s", self.path, e)
            self.failed = StoreError(f"this controller lost the writer lease of {self.path}: another controller took over")

    def _renew_loop(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        while not self._renewing.wait(self.lease_s / 3):
            try:
                if conn is None or conn.closed or conn.broken:
                    conn = psycopg.connect(self.url, autocommit=True, application_name="trainguard-lease", connect_timeout=5)
                renewed = conn.execute(
                    "UPDATE trainguard_lease SET expires_at = now() + make_interval(secs => %s)"
                    " WHERE name = 'writer' AND token = %s", (self.lease_s, self.lease_token)).rowcount
            except psycopg.Error as e:  # cut off: the lease runs out unless the database comes back in time
                log.warning("cannot renew the writer lease of %s: %s", self.path, e)
                continue
            if not renewed:
                self._deposed(StoreError("the lease has a newer token"))
                break
        if conn is not None:
            conn.close()

    def _release_lease(self) -> None:
        """Hand the lease over at once (a clean stop): a standby need not wait for it to expire."""
        self._renewing.set()
        if self._renewer is not None:
            self._renewer.join(self.lease_s)
        if self.lease_token is None or self.failed is not None:
            return
        try:
            with psycopg.connect(self.url, autocommit=True, application_name="trainguard-lease", connect_timeout=5) as conn:
                conn.execute("UPDATE trainguard_lease SET expires_at = '-infinity' WHERE name = 'writer' AND token = %s",
                             (self.lease_token,))
        except psycopg.Error as e:
            log.warning("could not release the writer lease of %s (it expires in %.0f s): %s", self.path, self.lease_s, e)

    def close(self, timeout: float = 10.0) -> None:
        """Commit what is queued (its callers get their outcome), hand the writer lease over, and
        close every connection (reads in flight finish first, bounded by ``timeout``)."""
        if self._closed:
            return
        self._commit_pending_now()
        self._release_lease()
        if self._close_reads(time.monotonic() + timeout):
            self._pool.close(timeout=timeout)
        with self._lock:
            if self._conn is not None:
                self._conn.close()
