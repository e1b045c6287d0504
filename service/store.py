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

Schema versions live in ``PRAGMA user_version``; :data:`MIGRATIONS` (``service/migrations.py``)
brings any older file up to date at start-up.

PostgreSQL (``--db postgresql://...``) is the other backend: :mod:`service.store_postgres`, the
same migrations and the same group commit (:class:`GroupCommitStore`, ``service/group_commit.py``),
chosen by :func:`open_store`.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any, Callable, TypeVar

from trainguard.service.group_commit import GroupCommitStore, StoreError
from trainguard.service.migrations import MIGRATIONS, check_version

__all__ = ["Store", "StoreError", "MIGRATIONS", "GroupCommitStore", "open_store", "is_database_url"]

log = logging.getLogger("trainguard.store")
T = TypeVar("T")


def _is_busy(e: sqlite3.OperationalError) -> bool:
    return getattr(e, "sqlite_errorcode", None) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED) or "locked" in str(e)


def _raise_if_ended(conn: sqlite3.Connection) -> None:
    """Inside ``except``: re-raise the operation's error when SQLite rolled the whole transaction
    back with it (a full disk, an I/O error), so that the batch fails naming that cause."""
    if not conn.in_transaction:
        raise


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


class Store(GroupCommitStore):
    """SQLite in WAL mode: one writer thread with group commit, per-thread readers."""

    def __init__(self, path: str | Path, *, busy_timeout_ms: int = 5000) -> None:
        self.path = Path(path)
        self.busy_timeout_ms = busy_timeout_ms
        if str(path) == ":memory:":
            raise ValueError("the store needs a file (readers and the writer share it)")
        self._init_queue()
        self._lock = threading.RLock()  # the writer connection is used by one caller at a time
        self._stop = threading.Event()
        self._checkpointer: threading.Thread | None = None
        self.checkpoint_every_s = 1.0
        self._local = threading.local()
        self._readers: list[sqlite3.Connection] = []
        try:
            self._conn = self._connect(readonly=False)
            self._migrate()
        except sqlite3.Error as e:  # not a database, a directory it cannot write in, a full disk
            raise StoreError(f"cannot use {self.path} as the controller's database: {e} (SQLite writes the file and, "
                             f"beside it, {self.path.name}-wal and {self.path.name}-shm)") from e

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
            check_version(self.path, version, len(MIGRATIONS))
            for target in range(version + 1, len(MIGRATIONS) + 1):
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    for stmt in MIGRATIONS[target - 1].split(";"):
                        if stmt.strip():
                            self._conn.execute(stmt)
                    self._conn.execute(f"PRAGMA user_version={target}")
                    self._conn.execute("COMMIT")
                except BaseException:
                    if self._conn.in_transaction:  # (SQLite ends it itself on a full disk)
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

    def free_bytes(self) -> int:
        """The room left to an unprivileged writer on the file system of the database's folder
        (``statvfs``: a system call that writes nothing)."""
        st = os.statvfs(self.path.parent)
        return st.f_bavail * st.f_frsize

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
                            _raise_if_ended(conn)
                            results.append((False, e))
                        continue
                    conn.execute("SAVEPOINT op")
                    try:
                        results.append((True, op(conn)))
                        conn.execute("RELEASE op")
                    except Exception as e:  # one bad operation fails alone
                        _raise_if_ended(conn)
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
                err.__cause__ = e
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
