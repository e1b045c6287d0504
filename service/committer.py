"""The transaction path every change of the controller's state takes (:mod:`service.transaction`):
its store operation written in the next group commit, then published — the webhook worker woken
for the outbox rows it wrote, its audit events to the event stream, then the caller's own
publishing; a failed commit takes the in-memory change back."""

from __future__ import annotations

import asyncio
import sqlite3
from typing import Any, Awaitable, Callable

from trainguard.service import statements as sql
from trainguard.service.events import EventHub
from trainguard.service.store import Store
from trainguard.service.transaction import Transaction, Written
from trainguard.service.webhooks import WebhookDeliverer

__all__ = ["Commit", "Committer", "Op"]

#: A transaction's store operation.
Op = Callable[[sqlite3.Connection], "Written | None"]
#: :meth:`Committer.commit`, as the services that write take it.
Commit = Callable[..., Awaitable[Written]]


class Committer:
    """Commits a :class:`~service.transaction.Transaction`'s store operation and publishes it."""

    def __init__(self, store: Store, deliverer: WebhookDeliverer, events_hub: EventHub) -> None:
        self.store = store
        self.deliverer = deliverer
        self.events_hub = events_hub

    async def commit(self, tx: Transaction, op: Op, *, after: Callable[[Written], None] | None = None,
                     single_statement: bool = False) -> Written:
        """Write ``op`` in the next group commit. After the commit: wake the webhook worker for
        the outbox rows it wrote, publish its events, then ``after`` (the caller's own
        publishing). If the commit fails: ``tx.rollback()`` and raise. A caller cancelled while
        waiting (its client went away) does not change the outcome: the operation still commits
        or fails, and is published or taken back then."""
        def run(c: sqlite3.Connection) -> Written:
            w = op(c) or Written()
            if w.events:
                w.published = sql.get_events(c, w.events)
            return w

        def published(w: Written) -> Written:
            if w.outbox:
                self.deliverer.wake(w.outbox)
            self.events_hub.publish(w.published)
            if after is not None:
                after(w)
            return w

        def orphaned(ok: bool, value: Any) -> None:
            published(value) if ok else tx.rollback()

        fut = self.store.submit(run, single_statement=single_statement, orphaned=orphaned)
        try:
            w = await fut
        except asyncio.CancelledError:
            if not fut.cancelled():  # the outcome arrived just before the cancellation
                orphaned(fut.exception() is None, fut.exception() or fut.result())
            raise  # else the store hands the outcome to orphaned() after the commit
        except BaseException:
            tx.rollback()
            raise
        return published(w)
