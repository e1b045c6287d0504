"""The standby role of a controller that shares its database (PostgreSQL) with an active one.

A controller whose store needs the writer lease listens from the start, but stands by until it
holds the lease: ``/healthz`` answers 200 (``{"status": "standby"}``: the process is alive),
``/readyz`` and every other path 503 with the reason, a ``Retry-After`` and the header
``X-Trainguard-Role: standby``, so that a load balancer routes around it and an agent given
several controller URLs moves on to the next one. A thread of its own waits for the lease
(:meth:`~trainguard.service.store_postgres.PostgresStore.take_lease`); once taken, the
controller loads what the rules need from the database and starts, and the same process serves.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["ROLE_HEADER", "Standby", "StandbyGate"]

log = logging.getLogger(__name__)

#: The header every answer of a controller standing by carries (value ``standby``).
ROLE_HEADER = b"x-trainguard-role"
#: Seconds one attempt to take the lease waits (then it tries again, e.g. after a database error).
_RETRY_S = 10.0


class Standby:
    """The lease waiter. ``take_lease(timeout)`` blocks until the lease is taken (``StoreError``
    after ``timeout`` without it); ``become_active()`` (a coroutine) loads and starts the
    controller once the lease is held. :class:`StandbyGate` answers for it meanwhile."""

    def __init__(self, *, take_lease: Callable[..., Any], become_active: Callable[[], Awaitable[None]],
                 database: str) -> None:
        self._take_lease = take_lease
        self._become_active = become_active
        self.database = database
        self.active = False
        self._stopping = threading.Event()
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle (the app's lifespan calls these) -----------------------------------------
    async def start(self) -> None:
        """Take the lease if it is free and become active before answering anything (the usual
        start of the first controller); else wait for it in a daemon thread and become active
        then, standing by meanwhile."""
        try:
            await asyncio.to_thread(self._take_lease, timeout=0)
        except Exception as exc:  # noqa: BLE001 - held by another (or the database is away): stand by
            log.warning("standing by: %s", exc)
        else:
            await self._become_active()
            self.active = True
            return
        loop = asyncio.get_running_loop()
        taken: asyncio.Future[None] = loop.create_future()

        def wait() -> None:
            while not self._stopping.is_set():
                try:
                    self._take_lease(timeout=_RETRY_S)
                except Exception as exc:  # noqa: BLE001 - held by another, or the database is away: try again
                    log.debug("standing by for the writer lease of %s: %s", self.database, exc)
                    continue
                try:
                    loop.call_soon_threadsafe(lambda: taken.done() or taken.set_result(None))
                except RuntimeError:  # the loop closed meanwhile: the app stopped
                    pass
                return

        threading.Thread(target=wait, name="trainguard-standby", daemon=True).start()

        async def take_over() -> None:
            await taken
            await self._become_active()
            self.active = True
            log.warning("this controller is now the active one for %s", self.database)

        self._task = asyncio.create_task(take_over())

    async def stop(self) -> bool:
        """Stop waiting. True if the controller had become active (and must be stopped)."""
        self._stopping.set()
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping either way
                pass
        return self.active



class StandbyGate:
    """ASGI middleware: every request passes once ``standby`` is active; until then the answers
    of the module docstring."""

    def __init__(self, app: Any, standby: Standby) -> None:
        self.app = app
        self.standby = standby

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if self.standby.active or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"] == "/healthz":
            await self._answer(send, 200, {"status": "standby"})
            return
        reason = (f"standby: another controller holds the writer lease of {self.standby.database}; "
                  "send this to the active controller")
        await self._answer(send, 503, {"status": reason} if scope["path"] == "/readyz" else {"detail": reason})

    @staticmethod
    async def _answer(send: Any, status: int, body: dict[str, str]) -> None:
        data = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                   (ROLE_HEADER, b"standby")]
        if status == 503:
            headers.append((b"retry-after", b"1"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})
