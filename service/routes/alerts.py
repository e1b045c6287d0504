"""Alerts, the audit log, and its Server-Sent Events stream."""

from __future__ import annotations

import asyncio
import json
import weakref
from typing import Annotated, Any, AsyncIterator, Callable, Literal

from fastapi import HTTPException, APIRouter, Header, Query, Request, Response

from trainguard.service.auth import TokenTable
from trainguard.service.controller import Controller
from trainguard.protocol.wire import MAX_INT
from trainguard.service.deps import ControllerDep, ReadDep
from trainguard.service.errors import TooMany
from trainguard.service.routes.ui_streams import EventStream
from trainguard.service.schemas import nan_safe
from trainguard.service.slots import Slots

__all__ = ["router", "StreamSlots", "STREAMS_PER_TOKEN", "STREAMS_TOTAL"]

router = APIRouter(prefix="/v1", tags=["alerts and events"])
_HEARTBEAT_S = 15.0
#: Longest an open stream goes without checking that its token is still live (not revoked or expired).
_LIVE_CHECK_S = 0.5
#: Event streams open at once: of one token, and in all.
STREAMS_PER_TOKEN = 16
STREAMS_TOTAL = 256


def _json(value: Any) -> Response:
    return Response(json.dumps(nan_safe(value)), media_type="application/json")


@router.get("/alerts", summary="Alerts, newest first")
async def alerts(
    ctl: ControllerDep, _: ReadDep, state: Literal["firing", "resolved"] | None = None, run: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100, before: Annotated[int | None, Query(ge=1, le=MAX_INT, description="Page: ids below this.")] = None,
) -> Response:
    return _json(await ctl.records.alerts(state=state, run=run, limit=limit, before=before))


@router.get("/runs/{run}/events", summary="A run's audit log: every change of desired state, alert and ack")
async def run_events(
    run: str, ctl: ControllerDep, _: ReadDep, after: Annotated[int, Query(ge=0, le=MAX_INT)] = 0, limit: Annotated[int, Query(ge=1, le=5000)] = 500,
) -> Response:
    await ctl.check_recorded(run)  # (a deleted run's audit log too)
    return _json(await ctl.records.events(run=run, after=after, limit=limit))


def _sse(event: dict[str, Any]) -> bytes:
    return f"id: {event['id']}\nevent: {event['kind']}\ndata: {json.dumps(nan_safe(event), separators=(',', ':'))}\n\n".encode()


async def _stream(ctl: Controller, run: str | None, after: int, alive: Callable[[], bool]) -> AsyncIterator[bytes]:
    """The audit events after id ``after`` (of ``run``, or all), then each new one as it happens;
    it ends as soon as ``alive()`` is false (the caller's token revoked or expired): checked before
    every write and at least every ``_LIVE_CHECK_S``, so nothing is sent after that."""
    queue = ctl.events_hub.subscribe()  # before the replay, so nothing falls between the two
    loop = asyncio.get_running_loop()
    try:
        yield b"retry: 2000\n\n"
        last = after
        while alive():
            page = await ctl.records.events(run=run, after=last, limit=1000)
            if not alive():
                return
            for ev in page:
                yield _sse(ev)
                last = ev["id"]
            if len(page) < 1000:
                break
        written = loop.time()
        while alive():
            try:
                ev = await asyncio.wait_for(queue.get(), _LIVE_CHECK_S)
            except TimeoutError:
                if not ctl.events_hub.is_subscribed(queue):
                    return  # dropped as too slow: the client reconnects with Last-Event-ID
                if loop.time() - written >= _HEARTBEAT_S:
                    written = loop.time()
                    yield b": keep-alive\n\n"
                continue
            if ev is None or not alive():
                return  # the controller is shutting down, or the token ended while it waited
            if ev["id"] <= last or (run is not None and ev["run"] != run):
                continue
            last = ev["id"]
            written = loop.time()
            yield _sse(ev)
    finally:
        ctl.events_hub.unsubscribe(queue)


class StreamSlots(Slots):
    """The open ``GET /v1/events/stream`` responses: at most ``per_token`` of one token and
    ``total`` in all (each is a subscriber every audit event is handed to)."""

    def __init__(self, per_token: int = STREAMS_PER_TOKEN, total: int = STREAMS_TOTAL) -> None:
        super().__init__(per_token, total, "event streams")


@router.get("/events/stream", summary="Server-Sent Events of the audit log (all runs, or one)",
            description=f"At most {STREAMS_PER_TOKEN} streams of one token and {STREAMS_TOTAL} in all are open at once "
            "(429 beyond). A stream ends once its token is revoked or expires.")
async def stream(
    request: Request, ctl: ControllerDep, principal: ReadDep, run: str | None = None,
    after: Annotated[int, Query(ge=0, le=MAX_INT)] = 0, last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
) -> EventStream:
    if last_event_id:
        # Only ASCII digits, at most 19 of them (str.isdigit() admits "²", which int() refuses,
        # and int() refuses more than 4,300 digits): anything else is a client error.
        if len(last_event_id) > 19 or not last_event_id.isascii() or not last_event_id.isdigit():
            raise HTTPException(400, "Last-Event-ID must be the id of an event (a decimal number of at most 19 digits)")
        after = max(after, min(int(last_event_id), MAX_INT))
    tokens: TokenTable = request.app.state.tokens
    try:
        release = request.app.state.event_streams.take(principal.token_digest or principal.actor)
    except TooMany as e:
        raise HTTPException(429, str(e), headers={"Retry-After": "5"}) from None
    body = _stream(ctl, run, after, lambda: tokens.is_live(principal))
    weakref.finalize(body, release)  # a stream the server never started still gives its place back
    return EventStream(body, release)
