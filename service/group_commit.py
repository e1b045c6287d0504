"""The group commit every store backend shares (:class:`GroupCommitStore`): the queue of
operations the event loop submits, one transaction for every operation submitted in one turn of
the loop (or in a worker thread while the write lock is held elsewhere), and the hand-back of
each operation's outcome to its caller's future, in the order that lets the callers take back
their in-memory changes (``service/transaction.py``). :class:`~service.store.Store` (SQLite) and
:class:`~service.store_postgres.PostgresStore` provide the transaction itself.
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
from typing import Any, Callable, Iterator, TypeVar

__all__ = ["Batch", "GroupCommitStore", "Orphaned", "StoreError", "is_disk_full", "ROOM_PROBE_BYTES"]

log = logging.getLogger("trainguard.store")
T = TypeVar("T")
#: Receives the outcome of an operation whose caller stopped waiting: (True, result) or (False, error).
Orphaned = Callable[[bool, Any], None]


class StoreError(RuntimeError):
    """The database could not be written (the caller should answer 503)."""


def is_disk_full(e: BaseException | None) -> bool:
    """Whether ``e`` says the database has no room: SQLite's SQLITE_FULL ("database or disk is
    full"), PostgreSQL's disk_full (SQLSTATE 53100)."""
    return getattr(e, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or getattr(e, "sqlstate", None) == "53100"


Batch = list[tuple[Callable[[Any], Any], bool]]
#: The size of the row a readiness probe writes after a full disk: room for a large report.
ROOM_PROBE_BYTES = 256 * 1024


def _probe_room(conn: Any) -> None:
    """Write a row of :data:`ROOM_PROBE_BYTES` and delete it in the same transaction: fails while the
    database has no room for it (random bytes: PostgreSQL cannot compress them away)."""
    conn.execute("INSERT INTO room_probe (pad) VALUES (?)", (os.urandom(ROOM_PROBE_BYTES),))
    conn.execute("DELETE FROM room_probe")


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
        #: A write failed for want of room (a full disk): readiness answers 503 with it until a
        #: write that needs room commits (``/readyz`` tries one: :meth:`probe`).
        self.out_of_room: str | None = None
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

    def free_bytes(self) -> int | None:
        """The room left where the database writes, when this backend can tell without writing
        (SQLite: its file system); ``None`` otherwise (PostgreSQL: a write finds out)."""
        return None

    @property
    def alive(self) -> bool:
        return self._started and not self._closed and self.failed is None

    def probe(self) -> asyncio.Future[None]:
        """The write readiness commits: an empty transaction; after a write failed for want of room
        (:attr:`out_of_room`), a row of :data:`ROOM_PROBE_BYTES` written and deleted, whose commit
        clears it."""
        full = self.out_of_room
        if full is None:
            return self.submit(lambda c: None, single_statement=True)

        def cleared(fut: asyncio.Future[None]) -> None:
            if not fut.cancelled() and fut.exception() is None and self.out_of_room == full:
                self.out_of_room = None  # (a write that failed meanwhile keeps its own reason)

        probe = self.submit(_probe_room)
        probe.add_done_callback(cleared)
        return probe

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
                if is_disk_full(value) or is_disk_full(value.__cause__):
                    self.out_of_room = str(value)
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

