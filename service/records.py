"""The stored records the routes read and write: alerts, the audit log, webhooks and their
deliveries. The routes reach the database through this class (``Controller.records``) and the
controller's own methods only, never through SQL."""

from __future__ import annotations

from typing import Any, Callable

from trainguard.service import statements as sql
from trainguard.service.errors import NotFound, TooMany
from trainguard.service.store import Store

__all__ = ["Records", "MAX_WEBHOOKS"]

#: Webhooks subscribed at once, at most (each alert and incident change writes one message per
#: webhook in the transaction that records it, on the reports' path).
MAX_WEBHOOKS = 100


class Records:
    """Queries and webhook subscriptions, each one store read or one write."""

    def __init__(self, store: Store, clock: Callable[[], float]) -> None:
        self._store = store
        self._clock = clock

    async def alerts(self, *, state: str | None, run: str | None, limit: int, before: int | None) -> list[dict[str, Any]]:
        """Alerts, newest first (ids below ``before``)."""
        return await self._store.read(lambda c: sql.list_alerts(c, state=state, run=run, limit=limit, before=before))

    async def events(self, *, run: str | None, after: int, limit: int) -> list[dict[str, Any]]:
        """Audit events after id ``after``, oldest first (of one run, or all)."""
        return await self._store.read(lambda c: sql.list_events(c, run=run, after=after, limit=limit))

    async def events_newest(self, *, run: str | None, before: int | None, limit: int) -> list[dict[str, Any]]:
        """Audit events with ids below ``before`` (from the newest when ``None``), newest first."""
        return await self._store.read(lambda c: sql.list_events_before(c, run=run, before=before, limit=limit))

    async def add_webhook(self, *, url: str, format: str, secret: str, min_severity: str, send_resolved: bool) -> tuple[int, float]:
        """Subscribe a webhook; returns (id, created_at). :class:`TooMany` when ``MAX_WEBHOOKS``
        are subscribed: every alert writes a message per webhook in its own transaction."""
        now = self._clock()

        def op(c: Any) -> int | None:
            if len(sql.active_webhooks(c)) >= MAX_WEBHOOKS:  # (at most that many rows)
                return None
            return sql.insert_webhook(c, url=url, format=format, secret=secret, min_severity=min_severity,
                                      send_resolved=send_resolved, now=now)

        wid = await self._store.submit(op)
        if wid is None:
            raise TooMany(f"{MAX_WEBHOOKS} webhooks are subscribed, the limit: delete one (DELETE /v1/webhooks/{{id}}) first")
        return wid, now

    async def webhooks(self) -> list[dict[str, Any]]:
        return await self._store.read(sql.active_webhooks)

    async def delete_webhook(self, webhook_id: int) -> None:
        """Delete a webhook and cancel its pending messages; NotFound if there is none."""
        now = self._clock()
        if not await self._store.submit(lambda c: sql.delete_webhook(c, webhook_id, now)):
            raise NotFound(f"webhook {webhook_id} does not exist")

    async def deliveries(self, webhook_id: int, limit: int) -> list[dict[str, Any]]:
        """A webhook's delivery attempts, newest first (also of a deleted one that has some)."""
        hook, rows = await self._store.read(lambda c: (sql.get_webhook(c, webhook_id), sql.list_deliveries(c, webhook_id, limit)))
        if hook is None and not rows:
            raise NotFound(f"webhook {webhook_id} does not exist")
        return rows

