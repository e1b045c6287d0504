"""The console's reads and live updates (``service/routes/ui.py``): the runs list, a run's window
and status as the pages read them, and the Server-Sent Events streams that keep them current,
built once per interval for every stream (:class:`StreamSnapshots`) and ended with their session.
"""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from collections import OrderedDict
from typing import Any, AsyncIterator, Callable

from fastapi import HTTPException, Request
from fastapi.responses import StreamingResponse

from trainguard.service.controller import Controller
from trainguard.service.errors import TooMany
from trainguard.service.routes.ui_sessions import COOKIE, Session
from trainguard.service.schemas import nan_safe

__all__ = ["StreamSnapshots", "EventStream", "open_stream", "runs_rows", "window_rows", "run_detail", "events_after", "EVENTS_KEPT"]

#: Audit events sent in one write of a stream (the rest follow in the next).
_EVENTS_PER_WRITE = 64
_TICK_S = 0.5
_RUNS_EVERY_S = 1.0
_HEARTBEAT_S = 15.0
EVENTS_KEPT = 500


def _run_row(st: Any) -> dict[str, Any]:
    d = st.detail()
    return {k: d[k] for k in ("run", "job", "status", "world_size", "last_step", "reports", "last_report_at",
                              "desired_generation", "applied_generation", "applied_step", "desired", "finished_step")} | {
        "firing": [{"rule": a["rule"], "severity": a["severity"], "summary": a["summary"]} for a in d["firing_alerts"]],
        "health": {k: d["last_values"].get(k) for k in ("trainguard_loss", "trainguard_grad_norm", "trainguard_tokens_per_second")},
    }


def runs_rows(ctl: Controller) -> list[dict[str, Any]]:
    return sorted((_run_row(st) for st in list(ctl.runs.values())), key=lambda r: r["run"])


def window_rows(st: Any, seq: int) -> dict[str, Any]:
    return {
        "rows": [{"seq": s, "step": step, "received": t, "values": v} for s, step, t, v in st.window.rows(seq)],
        "ranks": [{"seq": s, "vectors": v} for s, v in st.window.rank_rows(seq)],
    }


def run_detail(st: Any) -> dict[str, Any]:
    d = st.detail()
    d.pop("config", None)
    return d | {"window_capacity": st.window.capacity, "rank_window_capacity": st.window.rank_capacity}


async def events_after(ctl: Controller, run: str | None, after: int) -> list[dict[str, Any]]:
    """At most the newest ``EVENTS_KEPT`` audit events (of ``run``, or all) after id ``after``,
    oldest first: a page that was away longer gets the newest and skips the rest."""
    newest = await ctl.records.events_newest(run=run, before=None, limit=EVENTS_KEPT)
    return [ev for ev in reversed(newest) if ev["id"] > after]


def _sse(kind: str, data: Any, event_id: int | None = None) -> bytes:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {kind}\ndata: {json.dumps(nan_safe(data), separators=(',', ':'))}\n\n".encode()


class StreamSnapshots:
    """What the console's streams send, built once for all of them: the runs list at most every
    ``_RUNS_EVERY_S``, a run's status at most every ``_TICK_S``, a window update once per
    ``(run, from, to)`` and an audit event once. Each stream compares versions, so twenty streams
    of the same page cost one build and twenty small writes, not twenty builds."""

    _AUDIT_KEPT = 1024

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        #: ``None`` or (rebuild at, version, compared text, event bytes); per run for the status.
        self._runs: tuple[float, int, str, bytes] | None = None
        self._run: dict[str, tuple[float, int, str, bytes]] = {}
        self._window: dict[str, tuple[int, int, bytes]] = {}  # run -> (after seq, to seq, event bytes)
        self._audit: OrderedDict[int, bytes] = OrderedDict()

    @staticmethod
    def _next(old: tuple[float, int, str, bytes] | None, due: float, kind: str, state: Any) -> tuple[float, int, str, bytes]:
        text = json.dumps(nan_safe(state), sort_keys=True, separators=(",", ":"))
        if old is not None and old[2] == text:
            return due, old[1], old[2], old[3]
        return due, (old[1] + 1 if old is not None else 1), text, f"event: {kind}\ndata: {text}\n\n".encode()

    def runs(self, ctl: Controller) -> tuple[int, bytes]:
        """The runs list's version and its ``runs`` event."""
        now, old = self.clock(), self._runs
        if old is None or now >= old[0]:
            old = self._runs = self._next(old, now + _RUNS_EVERY_S, "runs", runs_rows(ctl))
        return old[1], old[3]

    def run(self, ctl: Controller, st: Any) -> tuple[int, bytes]:
        """Run ``st``'s status version and its ``run`` event."""
        now, old = self.clock(), self._run.get(st.run)
        if old is None or now >= old[0]:
            old = self._run[st.run] = self._next(old, now + _TICK_S, "run", run_detail(st))
            if len(self._run) > len(ctl.runs) + 64:  # runs gone since
                for name in [n for n in self._run if n not in ctl.runs]:
                    self._run.pop(name, None)
                    self._window.pop(name, None)
        return old[1], old[3]

    def window(self, st: Any, seq: int) -> bytes:
        """The ``report`` event of run ``st``'s reports after ``seq`` (empty when there are none)."""
        count = st.window.count
        if count <= seq:
            return b""
        cached = self._window.get(st.run)
        if cached is not None and cached[0] == seq and cached[1] == count:
            return cached[2]
        update = window_rows(st, seq)
        chunk = _sse("report", update) if update["rows"] or update["ranks"] else b""
        self._window[st.run] = (seq, count, chunk)
        return chunk

    def audit(self, ev: dict[str, Any]) -> bytes:
        chunk = self._audit.get(ev["id"])
        if chunk is None:
            chunk = self._audit[ev["id"]] = _sse("audit", ev, ev["id"])
            if len(self._audit) > self._AUDIT_KEPT:
                self._audit.popitem(last=False)
        return chunk


async def _replay(ctl: Controller, run: str | None, after: int, snapshots: StreamSnapshots) -> list[tuple[bytes, int]]:
    """The audit events after id ``after`` that a reconnecting page missed, each as its chunk and
    its id (none for a new page: ``after`` 0)."""
    if not after:
        return []
    return [(snapshots.audit(ev), ev["id"]) for ev in await events_after(ctl, run, after)]


async def _updates(ctl: Controller, run: str | None, seq: int, after: int, *, snapshots: StreamSnapshots | None = None,
                   alive: Callable[[], bool] = lambda: True, release: Callable[[], None] = lambda: None) -> AsyncIterator[bytes]:
    """Server-Sent Events for the console. With ``run``: ``report`` (new window rows after report ``seq``),
    ``audit`` (the run's audit events after id ``after``), ``run`` (its status, when it changed) and, last,
    ``gone`` (the run was deleted). Without: ``runs`` (the runs list, when it changed) and ``audit`` (every run's events).

    Per connection: the status and reports once per ``_TICK_S`` (the runs list at most every
    ``_RUNS_EVERY_S``), audit events in writes of at most ``_EVENTS_PER_WRITE``; each a lookup of
    what ``snapshots`` built for every stream. It ends (calling ``release``) when ``alive()`` says
    its session ended (sign-out, expiry, token revoked), when it falls behind, and at shutdown."""
    snapshots = snapshots or StreamSnapshots()
    hub = ctl.events_hub
    queue = hub.subscribe()  # before the replay, so nothing falls between the two
    loop = asyncio.get_running_loop()
    try:
        yield b"retry: 2000\n\n"
        for chunk, after in await _replay(ctl, run, after, snapshots):
            yield chunk
        sent = 0  # the version of the status this stream sent last
        next_state = written = loop.time()
        while alive():
            now = loop.time()
            if now >= next_state:
                next_state = now + _TICK_S
                state = _state_chunk(ctl, run, seq, sent, snapshots)
                if state is None:  # deleted: the page learns it, instead of reconnecting to a 404
                    yield _sse("gone", {"run": run})
                    return
                chunk, seq, sent = state
                if chunk:
                    written = now
                    yield chunk
            try:
                ev = await asyncio.wait_for(queue.get(), max(next_state - loop.time(), 0.0))
            except TimeoutError:
                if not hub.is_subscribed(queue):
                    return  # dropped as too slow: the page reconnects from its cursors
                if loop.time() - written >= _HEARTBEAT_S:
                    written = loop.time()
                    yield b": keep-alive\n\n"
                continue
            chunk, after, ended = _audit_chunk(queue, ev, run, after, snapshots)
            if chunk:
                written = loop.time()
                yield chunk
            if ended:
                return
    finally:
        hub.unsubscribe(queue)
        release()


def _state_chunk(ctl: Controller, run: str | None, seq: int, sent: int,
                 snapshots: StreamSnapshots) -> tuple[bytes, int, int] | None:
    """One tick's status: the run's new window rows and its status when it changed (or the runs
    list when it changed), with the stream's new cursors ``(chunk, seq, sent)``; None when the
    run is gone."""
    out = []
    if run is not None:
        st = ctl.runs.get(run)
        if st is None:
            return None
        out.append(snapshots.window(st, seq))
        seq = max(seq, st.window.count)
        version, chunk = snapshots.run(ctl, st)
    else:
        version, chunk = snapshots.runs(ctl)
    if version != sent:
        sent = version
        out.append(chunk)
    return b"".join(out), seq, sent


def _audit_chunk(queue: asyncio.Queue, ev: dict[str, Any] | None, run: str | None, after: int,
                 snapshots: StreamSnapshots) -> tuple[bytes, int, bool]:
    """``ev`` and the events already queued behind it (at most ``_EVENTS_PER_WRITE``) as one write:
    ``(chunk, after, ended)``, ``ended`` when the controller is shutting down (a None event)."""
    batch = [ev]
    while ev is not None and len(batch) < _EVENTS_PER_WRITE and not queue.empty():
        batch.append(ev := queue.get_nowait())
    out = []
    for ev in batch:
        if ev is None:
            break  # the controller is shutting down
        if ev["id"] > after and (run is None or ev["run"] == run):
            after = ev["id"]
            out.append(snapshots.audit(ev))
    return b"".join(out), after, batch[-1] is None


def _stream(request: Request, session: Session, run: str | None, seq: int, after: int) -> StreamingResponse:
    """A stream for ``session`` (429 beyond the limits), ended when the session or its token ends."""
    sessions = request.app.state.console_sessions
    release = sessions.open_stream(session)
    sid, tokens = request.cookies.get(COOKIE), request.app.state.tokens

    def alive() -> bool:
        return sessions.get(sid) is session and tokens.is_live(session.principal)

    body = _updates(request.app.state.controller, run, seq, after, snapshots=request.app.state.console_streams, alive=alive,
                    release=release)
    weakref.finalize(body, release)  # a stream the server never started still gives its place back
    return EventStream(body, release)


class EventStream(StreamingResponse):
    """An event stream that gives its place back as soon as the response ends, however it ends
    (a client that goes away cancels the response while the body waits at a ``yield``, and the
    body itself is only closed when it is collected)."""

    def __init__(self, body: AsyncIterator[bytes], release: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


def open_stream(request: Request, session: Session, run: str | None, seq: int, after: int) -> StreamingResponse:
    try:
        return _stream(request, session, run, seq, after)
    except TooMany as e:
        raise HTTPException(429, str(e), headers={"Retry-After": "5"}) from None
