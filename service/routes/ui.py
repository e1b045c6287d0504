"""The operator console at ``/ui``: pages, sign-in, and the JSON and event-stream endpoints its
scripts call; also the API docs page (``/docs``) with locally served assets.

Sign-in takes the same operator tokens and scopes as the API: ``POST /ui/login`` with the token in
a JSON body answers a session cookie (HttpOnly, SameSite=Strict, path ``/ui``) and a CSRF token; the
token itself never appears in a URL, a cookie or a log line. Every console request is authorised
by the session (401 without one, 403 without the scope); every state-changing request also needs
the session's CSRF token in ``X-CSRF-Token`` (403 otherwise) and, when the browser sends an
``Origin``, the controller's own. Without configured tokens (the controller then binds to loopback
only) the console opens an anonymous session by itself: there is nothing to sign in with.

A session is bound to the token it signed in with: once that token is revoked or expires, the
session's next request (read, command or a stream's next tick) answers 401. Sessions live in the
controller's memory (12 hours each, at most ``_SESSIONS_PER_TOKEN`` per token: a sign-in beyond
that ends the same token's oldest session, never another token's): a restart signs everyone out.
Failed sign-ins are rate limited per client address and in all (:class:`LoginLimiter`; 429 with
``Retry-After``). Live updates (``/ui/api/stream``, ``/ui/api/runs/{run}/stream``) are built once
per interval for every stream (:class:`StreamSnapshots`), sent at most every tick per connection,
and capped per session and in all (429 beyond).
The pages are one HTML shell and plain JavaScript modules under ``service/ui`` (no build step);
the charts use the vendored uPlot.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import secrets
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Annotated, Any, AsyncIterator, Awaitable, Callable
from urllib.parse import urlsplit

from fastapi import APIRouter, Body, Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field, ValidationError

from trainguard.protocol.command_inputs import command_inputs, validation_message
from trainguard.protocol.commands import REGISTRY, CommandRefused, CommandSpec, apply_command
from trainguard.protocol.wire import MAX_INT
from trainguard.service.auth import ANONYMOUS, Principal, TokenTable
from trainguard.service.controller import Controller
from trainguard.service.errors import TooMany
from trainguard.service.schemas import nan_safe

__all__ = ["router", "install", "ConsoleSessions", "LoginLimiter", "StreamSnapshots", "COOKIE", "CSRF_HEADER"]

log = logging.getLogger("trainguard.service.ui")

UI_DIR = Path(str(files("trainguard.service") / "ui"))
COOKIE = "trainguard_session"
CSRF_HEADER = "X-CSRF-Token"
_SESSION_TTL_S = 12 * 3600.0
_MAX_SESSIONS = 1024
#: Sessions one token may hold at once (one per browser or tab that signed in with it).
_SESSIONS_PER_TOKEN = 16
#: Live-update streams one session may hold (a page holds one), and all sessions together.
_STREAMS_PER_SESSION = 6
_STREAMS_TOTAL = 64
#: Failed sign-ins: a burst of this many per client address, then one per this many seconds;
#: and in all (every address together).
_LOGIN_BURST, _LOGIN_REFILL_S = 10, 6.0
_LOGIN_BURST_TOTAL, _LOGIN_REFILL_TOTAL_S = 100, 1.0
_LOGIN_ADDRESSES = 4096
#: Audit events sent in one write of a stream (the rest follow in the next).
_EVENTS_PER_WRITE = 64
_TICK_S = 0.5
_RUNS_EVERY_S = 1.0
_HEARTBEAT_S = 15.0
_EVENTS_KEPT = 500
#: The console's actions: the registry's operator commands it shows, by their URL spelling (the API's).
_ACTIONS: dict[str, CommandSpec] = {spec.url: spec for spec in REGISTRY if spec.operator and spec.console}
#: Actions the console asks to confirm as dangerous (they end the loop or discard training state).
_DANGEROUS = frozenset({"stop", "rollback", "reset_optimizer"})
_PAGE_HEADERS = {
    # Scripts, styles, images and connections only from the controller itself: the console works
    # with no network but the controller's, and injected markup cannot load anything.
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

router = APIRouter(include_in_schema=False)


@dataclass(slots=True)
class Session:
    principal: Principal
    csrf: str
    expires: float
    streams: int = 0
    """Live-update streams open under this session."""


class ConsoleSessions:
    """Signed-in browsers: session id -> principal and CSRF token.

    A session expires ``ttl_s`` after sign-in. At most ``per_token`` sessions per token: a
    sign-in beyond that ends that token's oldest session. In all at most ``capacity``: a sign-in
    beyond that ends the token's own oldest session if it has one, else an expired one, else it
    is refused (:class:`TooMany`) - it never ends another token's live session. Streams are
    counted per session (``streams_per_session``) and in all (``streams_total``)."""

    def __init__(self, *, ttl_s: float = _SESSION_TTL_S, capacity: int = _MAX_SESSIONS, per_token: int = _SESSIONS_PER_TOKEN,
                 streams_per_session: int = _STREAMS_PER_SESSION, streams_total: int = _STREAMS_TOTAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0 or min(capacity, per_token, streams_per_session, streams_total) < 1:
            raise ValueError("ttl_s must be > 0, and capacity, per_token and the stream limits >= 1")
        self.ttl_s, self.capacity, self.per_token, self.clock = ttl_s, capacity, per_token, clock
        self.streams_per_session, self.streams_total = streams_per_session, streams_total
        self.streams = 0
        self._by_id: OrderedDict[str, Session] = OrderedDict()
        #: Each token's sessions (by digest; the anonymous caller by its actor), oldest first.
        self._by_token: dict[str, OrderedDict[str, None]] = {}

    @staticmethod
    def _key(principal: Principal) -> str:
        return principal.token_digest or principal.actor

    def open(self, principal: Principal) -> tuple[str, Session]:
        own = self._by_token.get(self._key(principal))
        if own and len(own) >= self.per_token:
            self.close(next(iter(own)))
        if len(self._by_id) >= self.capacity:
            if own:
                self.close(next(iter(own)))
            else:
                self._drop_expired()
            if len(self._by_id) >= self.capacity:
                raise TooMany(f"the console holds {len(self._by_id)} sessions, its limit: sign out elsewhere "
                              "or wait for sessions to expire")
        sid = secrets.token_urlsafe(32)
        session = self._by_id[sid] = Session(principal, secrets.token_urlsafe(32), self.clock() + self.ttl_s)
        self._by_token.setdefault(self._key(principal), OrderedDict())[sid] = None
        return sid, session

    def _drop_expired(self) -> None:
        now = self.clock()
        for sid in [sid for sid, s in self._by_id.items() if s.expires <= now]:
            self.close(sid)

    def get(self, sid: str | None) -> Session | None:
        if not sid:
            return None
        session = self._by_id.get(sid)
        if session is not None and session.expires <= self.clock():
            self.close(sid)
            return None
        return session

    def close(self, sid: str | None) -> None:
        if not sid:
            return
        session = self._by_id.pop(sid, None)
        if session is not None:
            key = self._key(session.principal)
            own = self._by_token.get(key)
            if own is not None:
                own.pop(sid, None)
                if not own:
                    del self._by_token[key]

    def open_stream(self, session: Session) -> Callable[[], None]:
        """Count a stream of ``session`` (429 beyond the limits); answers its release (idempotent)."""
        if session.streams >= self.streams_per_session:
            raise TooMany(f"this console session has {session.streams} live-update streams open, its limit: close a page "
                          "(or sign in again from another browser)")
        if self.streams >= self.streams_total:
            raise TooMany(f"the console serves {self.streams} live-update streams, its limit: try again later")
        session.streams += 1
        self.streams += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                session.streams -= 1
                self.streams -= 1

        return release

    def __len__(self) -> int:
        return len(self._by_id)


class LoginLimiter:
    """Token buckets of failed sign-ins, per client address and in all: each failure takes one;
    a bucket refills one per ``refill_s`` up to ``burst``. An empty bucket refuses sign-ins from
    that address (or, for the total, from everyone) before the token is even checked, so guessing
    learns nothing while it lasts. At most ``addresses`` addresses are tracked (the least recently
    failed beyond that are forgotten; the total bucket still holds)."""

    def __init__(self, *, burst: int = _LOGIN_BURST, refill_s: float = _LOGIN_REFILL_S, burst_total: int = _LOGIN_BURST_TOTAL,
                 refill_total_s: float = _LOGIN_REFILL_TOTAL_S, addresses: int = _LOGIN_ADDRESSES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if min(burst, burst_total, addresses) < 1 or min(refill_s, refill_total_s) <= 0:
            raise ValueError("bursts and addresses must be >= 1 and refill periods > 0")
        self.burst, self.refill_s, self.burst_total, self.refill_total_s = burst, refill_s, burst_total, refill_total_s
        self.addresses, self.clock = addresses, clock
        self._by_address: OrderedDict[str, tuple[float, float]] = OrderedDict()  # address -> (level, at)
        self._total = (float(burst_total), clock())

    @staticmethod
    def _level(bucket: tuple[float, float], burst: int, refill_s: float, now: float) -> float:
        level, at = bucket
        return min(float(burst), level + (now - at) / refill_s)

    def retry_after(self, address: str) -> float:
        """Seconds until ``address`` may try again (0: now)."""
        now = self.clock()
        mine = self._by_address.get(address)
        wait = 0.0
        if mine is not None:
            wait = max(wait, (1.0 - self._level(mine, self.burst, self.refill_s, now)) * self.refill_s)
        wait = max(wait, (1.0 - self._level(self._total, self.burst_total, self.refill_total_s, now)) * self.refill_total_s)
        return wait

    def failed(self, address: str) -> None:
        now = self.clock()
        mine = self._by_address.pop(address, None)
        level = self._level(mine, self.burst, self.refill_s, now) if mine is not None else float(self.burst)
        self._by_address[address] = (level - 1.0, now)
        while len(self._by_address) > self.addresses:
            self._by_address.popitem(last=False)
        self._total = (self._level(self._total, self.burst_total, self.refill_total_s, now) - 1.0, now)


def _sessions(request: Request) -> ConsoleSessions:
    return request.app.state.console_sessions


def _secure(request: Request) -> bool:
    """Whether the browser reaches the console over https (directly, or through a TLS proxy
    whose public address is TRAINGUARD_EXTERNAL_URL)."""
    return request.url.scheme == "https" or request.app.state.settings.external_url.startswith("https://")


def _set_cookie(response: Response, request: Request, sid: str, ttl_s: float) -> None:
    response.set_cookie(COOKIE, sid, max_age=int(ttl_s), path="/ui", httponly=True, samesite="strict",
                        secure=_secure(request))


def _origin_key(scheme: str, netloc: str) -> tuple[str, str, int | None] | None:
    """``(scheme, host, port)`` of an origin, the port made explicit for http and https; ``None``
    when it does not parse."""
    try:
        parts = urlsplit(f"{scheme}://{netloc}")
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname:
        return None
    scheme = scheme.lower()
    return scheme, parts.hostname.lower(), port if port is not None else {"http": 80, "https": 443}.get(scheme)


def _check_origin(request: Request) -> None:
    """Refuse a state-changing request whose ``Origin`` is another site's: scheme, host and port
    must all be the controller's (as the browser reached it, or TRAINGUARD_EXTERNAL_URL's).
    SameSite=Strict already keeps the cookie off cross-site requests; this also covers browsers
    that ignore it."""
    origin = request.headers.get("origin")
    if origin is None:
        return
    allowed = {_origin_key(request.url.scheme, request.headers.get("host", ""))}
    external = request.app.state.settings.external_url
    if external:  # behind a proxy that rewrites Host, the public address the browser uses
        parts = urlsplit(external)
        allowed.add(_origin_key(parts.scheme, parts.netloc))
    parts = urlsplit(origin)
    key = _origin_key(parts.scheme, parts.netloc) if parts.scheme in ("http", "https") else None
    if key is None or key not in allowed:
        raise HTTPException(403, "cross-origin request refused: the Origin's scheme, host and port must be this "
                            "controller's (behind a proxy, set TRAINGUARD_EXTERNAL_URL to the public address)")


def _live_session(request: Request) -> Session | None:
    """The request's session while it and the token it signed in with are valid; a session whose
    token was revoked or expired ends here."""
    sessions = _sessions(request)
    sid = request.cookies.get(COOKIE)
    session = sessions.get(sid)
    if session is not None and not request.app.state.tokens.is_live(session.principal):
        sessions.close(sid)
        return None
    return session


def _session_dep(scope: str | None, *, csrf: bool) -> Callable[[Request], Awaitable[Session]]:
    async def dep(request: Request) -> Session:
        session = _live_session(request)
        if session is None:
            raise HTTPException(401, "not signed in to the console (POST /ui/login with an operator token)")
        if csrf:
            _check_origin(request)
            sent = request.headers.get(CSRF_HEADER, "")
            if not hmac.compare_digest(sent.encode(), session.csrf.encode()):
                raise HTTPException(403, f"missing or wrong {CSRF_HEADER} header")
        if scope is not None and scope not in session.principal.scopes:
            raise HTTPException(403, f"this operator token lacks the '{scope}' scope")
        return session

    return dep


ReadSession = Annotated[Session, Depends(_session_dep("read", csrf=False))]
AnySession = Annotated[Session, Depends(_session_dep(None, csrf=True))]


def _controller(request: Request) -> Controller:
    return request.app.state.controller


def _json(value: Any, status: int = 200) -> Response:
    return Response(json.dumps(nan_safe(value)), status_code=status, media_type="application/json",
                    headers={"Cache-Control": "no-store"})


def _session_body(session: Session, auth: bool) -> dict[str, Any]:
    p = session.principal
    return {"signed_in": True, "auth_required": auth, "kind": p.kind, "actor": p.actor,
            "scopes": sorted(p.scopes & {"read", "command", "rules", "webhooks"}), "csrf": session.csrf}


# -- pages ------------------------------------------------------------------------------------------
def _page() -> FileResponse:
    return FileResponse(UI_DIR / "index.html", media_type="text/html", headers=_PAGE_HEADERS)


@router.get("/")
async def root() -> RedirectResponse:
    return RedirectResponse("/ui", status_code=307)


@router.get("/ui")
async def runs_page() -> FileResponse:
    return _page()


@router.get("/ui/runs/{run}")
async def run_page(run: str) -> FileResponse:
    return _page()


@router.get("/ui/audit")
async def audit_page() -> FileResponse:
    return _page()


# -- sign-in ------------------------------------------------------------------------------------------
class Login(BaseModel):
    token: str = Field(min_length=1, max_length=4096)


@router.get("/ui/api/session")
async def session_info(request: Request) -> Response:
    """The caller's session; without configured tokens, opens an anonymous one."""
    tokens: TokenTable = request.app.state.tokens
    sessions = _sessions(request)
    session = _live_session(request)
    if session is not None:
        return _json(_session_body(session, tokens.enabled))
    if tokens.enabled:
        return _json({"signed_in": False, "auth_required": True})
    sid, session = sessions.open(ANONYMOUS)
    response = _json(_session_body(session, False))
    _set_cookie(response, request, sid, sessions.ttl_s)
    return response


@router.post("/ui/login")
async def login(request: Request) -> Response:
    """Exchange an operator token (JSON body ``{"token": ...}``) for a session cookie."""
    _check_origin(request)
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
        raise HTTPException(415, "send the token as JSON: {\"token\": \"...\"}")
    try:
        body = Login.model_validate_json(await request.body())
    except ValidationError:
        raise HTTPException(422, "send the token as JSON: {\"token\": \"...\"}") from None
    tokens: TokenTable = request.app.state.tokens
    limiter: LoginLimiter = request.app.state.console_logins
    address = request.client.host if request.client else ""
    wait = limiter.retry_after(address)
    if wait > 0:
        retry = max(1, math.ceil(wait))
        raise HTTPException(429, f"too many failed sign-ins; try again in {retry} s", headers={"Retry-After": str(retry)})
    principal = tokens.authenticate(f"Bearer {body.token}")
    if principal is None:
        limiter.failed(address)
        log.warning("console sign-in with an unknown token from %r", address)
        raise HTTPException(401, "unknown token")
    if principal.kind == "agent":
        raise HTTPException(403, "agent tokens cannot sign in to the console: use an operator token")
    sessions = _sessions(request)
    sessions.close(request.cookies.get(COOKIE))
    try:
        sid, session = sessions.open(principal)
    except TooMany as e:
        raise HTTPException(429, str(e)) from None
    response = _json(_session_body(session, tokens.enabled))
    _set_cookie(response, request, sid, sessions.ttl_s)
    return response


@router.post("/ui/logout")
async def logout(request: Request, _: AnySession) -> Response:
    _sessions(request).close(request.cookies.get(COOKIE))
    response = _json({"signed_in": False})
    response.delete_cookie(COOKIE, path="/ui", httponly=True, samesite="strict", secure=_secure(request))
    return response


# -- reads ------------------------------------------------------------------------------------------
def _run_row(st: Any) -> dict[str, Any]:
    d = st.detail()
    return {k: d[k] for k in ("run", "job", "status", "world_size", "last_step", "reports", "last_report_at",
                              "desired_generation", "applied_generation", "applied_step", "desired", "finished_step")} | {
        "firing": [{"rule": a["rule"], "severity": a["severity"], "summary": a["summary"]} for a in d["firing_alerts"]],
        "health": {k: d["last_values"].get(k) for k in ("trainguard_loss", "trainguard_grad_norm", "trainguard_tokens_per_second")},
    }


def _runs(ctl: Controller) -> list[dict[str, Any]]:
    return sorted((_run_row(st) for st in list(ctl.runs.values())), key=lambda r: r["run"])


def _window(st: Any, seq: int) -> dict[str, Any]:
    return {
        "rows": [{"seq": s, "step": step, "received": t, "values": v} for s, step, t, v in st.window.rows(seq)],
        "ranks": [{"seq": s, "vectors": v} for s, v in st.window.rank_rows(seq)],
    }


def _detail(st: Any) -> dict[str, Any]:
    d = st.detail()
    d.pop("config", None)
    return d | {"window_capacity": st.window.capacity, "rank_window_capacity": st.window.rank_capacity}


async def _events_after(ctl: Controller, run: str | None, after: int) -> list[dict[str, Any]]:
    """At most the newest ``_EVENTS_KEPT`` audit events (of ``run``, or all) after id ``after``,
    oldest first: a page that was away longer gets the newest and skips the rest."""
    newest = await ctl.records.events_newest(run=run, before=None, limit=_EVENTS_KEPT)
    return [ev for ev in reversed(newest) if ev["id"] > after]


async def _alerts(ctl: Controller, run: str) -> list[dict[str, Any]]:
    return await ctl.records.alerts(state=None, run=run, limit=100, before=None)


@router.get("/ui/api/runs")
async def api_runs(request: Request, _: ReadSession) -> Response:
    return _json(_runs(_controller(request)))


@router.get("/ui/api/runs/{run}")
async def api_run(run: str, request: Request, _: ReadSession) -> Response:
    """A run's status, its window (reports and per-rank vectors), its recent alerts with their
    diagnoses, its incidents (onset, rungs, outcome; newest first) and its recent audit events."""
    ctl = _controller(request)
    st = ctl.get(run)
    alerts = await _alerts(ctl, run)
    events = (await ctl.records.events_newest(run=run, before=None, limit=_EVENTS_KEPT))[::-1]
    return _json({"run": _detail(st), "window": _window(st, 0), "alerts": alerts,
                  "incidents": st.incidents()["incidents"], "events": events})


@router.get("/ui/api/runs/{run}/incidents")
async def api_incidents(run: str, request: Request, _: ReadSession) -> Response:
    """A run's incidents, newest first (the page reloads them when an ``incident`` event arrives),
    and the snapshots the controller holds for it."""
    return _json(_controller(request).get(run).incidents())


@router.get("/ui/api/runs/{run}/alerts")
async def api_alerts(run: str, request: Request, _: ReadSession) -> Response:
    """A run's newest 100 alerts (firing and resolved) with their diagnoses, newest first."""
    ctl = _controller(request)
    ctl.get(run)
    return _json(await _alerts(ctl, run))


@router.get("/ui/api/events")
async def api_events(
    request: Request, _: ReadSession, before: Annotated[int | None, Query(ge=1, le=MAX_INT)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
) -> Response:
    """The audit log of every run, newest first: ``limit`` events with ids below ``before``."""
    page = await _controller(request).records.events_newest(run=None, before=before, limit=limit)
    return _json({"events": page, "before": page[-1]["id"] if len(page) == limit else None})


# -- live updates -----------------------------------------------------------------------------------
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
            old = self._runs = self._next(old, now + _RUNS_EVERY_S, "runs", _runs(ctl))
        return old[1], old[3]

    def run(self, ctl: Controller, st: Any) -> tuple[int, bytes]:
        """Run ``st``'s status version and its ``run`` event."""
        now, old = self.clock(), self._run.get(st.run)
        if old is None or now >= old[0]:
            old = self._run[st.run] = self._next(old, now + _TICK_S, "run", _detail(st))
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
        update = _window(st, seq)
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


async def _updates(ctl: Controller, run: str | None, seq: int, after: int, *, snapshots: StreamSnapshots | None = None,
                   alive: Callable[[], bool] = lambda: True, release: Callable[[], None] = lambda: None) -> AsyncIterator[bytes]:
    """Server-Sent Events for the console. With ``run``: ``report`` (new window rows after report
    ``seq``), ``audit`` (the run's audit events after id ``after``) and ``run`` (its status, when it
    changed). Without: ``runs`` (the runs list, when it changed) and ``audit`` (every run's events).

    Per connection, the status and reports are looked at once per ``_TICK_S`` (the runs list
    changes at most every ``_RUNS_EVERY_S``) and audit events are sent in writes of at most
    ``_EVENTS_PER_WRITE``, whatever the rate of events: each costs a lookup of what
    ``snapshots`` built for every stream. The stream ends when ``alive()`` says its session ended
    (sign-out, expiry, its token revoked), when it falls behind the event hub, and at shutdown;
    ``release`` is called then."""
    snapshots = snapshots or StreamSnapshots()
    hub = ctl.events_hub
    queue = hub.subscribe()  # before the replay, so nothing falls between the two
    loop = asyncio.get_running_loop()
    try:
        yield b"retry: 2000\n\n"
        if after:
            for ev in await _events_after(ctl, run, after):
                yield snapshots.audit(ev)
                after = ev["id"]
        sent = 0  # the version of the status this stream sent last
        next_state = written = loop.time()
        while alive():
            now = loop.time()
            if now >= next_state:
                next_state = now + _TICK_S
                out = []
                if run is not None:
                    st = ctl.runs.get(run)
                    if st is None:
                        return
                    out.append(snapshots.window(st, seq))
                    seq = max(seq, st.window.count)
                    version, chunk = snapshots.run(ctl, st)
                else:
                    version, chunk = snapshots.runs(ctl)
                if version != sent:
                    sent = version
                    out.append(chunk)
                if any(out):
                    written = now
                    yield b"".join(out)
            try:
                ev = await asyncio.wait_for(queue.get(), max(next_state - loop.time(), 0.0))
            except TimeoutError:
                if not hub.is_subscribed(queue):
                    return  # dropped as too slow: the page reconnects from its cursors
                if loop.time() - written >= _HEARTBEAT_S:
                    written = loop.time()
                    yield b": keep-alive\n\n"
                continue
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
            if out:
                written = loop.time()
                yield b"".join(out)
            if batch[-1] is None:
                return
    finally:
        hub.unsubscribe(queue)
        release()


def _stream(request: Request, session: Session, run: str | None, seq: int, after: int) -> StreamingResponse:
    """A stream for ``session`` (429 beyond the limits), ended when the session or its token ends."""
    sessions = _sessions(request)
    release = sessions.open_stream(session)
    sid, tokens = request.cookies.get(COOKIE), request.app.state.tokens

    def alive() -> bool:
        return sessions.get(sid) is session and tokens.is_live(session.principal)

    body = _updates(_controller(request), run, seq, after, snapshots=request.app.state.console_streams, alive=alive,
                    release=release)
    weakref.finalize(body, release)  # a stream the server never started still gives its place back
    return _EventStream(body, release)


class _EventStream(StreamingResponse):
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


@router.get("/ui/api/stream")
async def api_stream(request: Request, session: ReadSession, after: Annotated[int, Query(ge=0, le=MAX_INT)] = 0) -> StreamingResponse:
    return _open(request, session, None, 0, after)


@router.get("/ui/api/runs/{run}/stream")
async def api_run_stream(
    run: str, request: Request, session: ReadSession, seq: Annotated[int, Query(ge=0, le=MAX_INT)] = 0,
    after: Annotated[int, Query(ge=0, le=MAX_INT)] = 0,
) -> StreamingResponse:
    _controller(request).get(run)
    return _open(request, session, run, seq, after)


def _open(request: Request, session: Session, run: str | None, seq: int, after: int) -> StreamingResponse:
    try:
        return _stream(request, session, run, seq, after)
    except TooMany as e:
        raise HTTPException(429, str(e), headers={"Retry-After": "5"}) from None


# -- actions ------------------------------------------------------------------------------------------
def _commands() -> list[dict[str, Any]]:
    return [{"name": spec.name, "url": spec.url, "summary": spec.summary, "kind": spec.kind, "scope": spec.scope,
             "dangerous": spec.name in _DANGEROUS, "state": [f.name for f in spec.fields],
             "fields": [inp.as_json() for inp in command_inputs(spec.request)]} for spec in _ACTIONS.values()]


@router.get("/ui/api/commands")
async def api_commands(_: ReadSession) -> Response:
    """The actions the console offers (the registry's operator commands): name, URL spelling,
    summary, kind (control or diagnostic), the scope it needs, whether it is dangerous, the
    desired-state fields it sets, and the fields of its body (name, type, bounds, choices, default,
    required) as its request model declares them."""
    return _json(_commands())


def _action(command: str, session: Session, body: dict[str, Any] | None) -> tuple[CommandSpec, Any]:
    """The action ``command`` (404 unknown; 403 without its scope) and its body validated by its
    request model (422 with the model's message)."""
    spec = _ACTIONS.get(command)
    if spec is None:
        raise HTTPException(404, f"unknown action {command!r}; known: {', '.join(_ACTIONS)}")
    if spec.scope not in session.principal.scopes:
        raise HTTPException(403, f"this operator token lacks the '{spec.scope}' scope")
    try:
        return spec, spec.request.model_validate(body or {})
    except ValidationError as e:
        raise HTTPException(422, validation_message(e)) from None


@router.post("/ui/api/runs/{run}/{command}/preview")
async def api_preview(run: str, command: str, request: Request, session: AnySession,
                      body: Annotated[dict[str, Any] | None, Body()] = None) -> Response:
    """What the action would change in the run's desired state now (``changes``: field, now,
    after; the generation last when anything changes) and the note it would record; 409 when the
    controller would refuse it, with the reason. Nothing is changed."""
    spec, params = _action(command, session, body)
    st = _controller(request).get(run)
    if spec.requires_config is not None and not isinstance(st.config.get(spec.requires_config[0]), int):
        key, why = spec.requires_config  # the words Controller.command refuses it with
        raise HTTPException(409, f"run {run!r} does not let the controller set its {key.replace('_', ' ')} ({why})")
    try:
        updates, note = apply_command(st.desired, spec, params, st.recovery)
    except CommandRefused as e:
        raise HTTPException(409, str(e)) from None
    changes = [{"field": k, "now": getattr(st.desired, k), "after": v} for k, v in updates.items()]
    if changes:
        changes.append({"field": "generation", "now": st.desired.generation, "after": st.desired.generation + 1})
    return _json({"command": spec.name, "changes": changes, "note": note})


@router.post("/ui/api/runs/{run}/{command}")
async def api_command(run: str, command: str, request: Request, session: AnySession,
                      body: Annotated[dict[str, Any] | None, Body()] = None) -> Response:
    """Any action of ``GET /ui/api/commands`` (body: its fields and ``reason``), as the
    signed-in operator."""
    spec, params = _action(command, session, body)
    actor = session.principal.actor
    status, answer = await _controller(request).command(
        run, spec.name, params=params, reason=params.reason or f"{command} from the console by {actor}", actor=actor,
        source="operator")
    return Response(answer, status_code=status, media_type="application/json")


# -- the app ------------------------------------------------------------------------------------------
def install(app: FastAPI) -> None:
    """Add the console (routes, static assets, sessions) and the local API docs page to ``app``
    (built with ``docs_url=None``)."""
    app.state.console_sessions = ConsoleSessions()
    app.state.console_logins = LoginLimiter()
    app.state.console_streams = StreamSnapshots()
    app.include_router(router)
    app.mount("/ui/static", StaticFiles(directory=UI_DIR), name="ui-static")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json", title=f"{app.title} - API docs",
            swagger_js_url="/ui/static/vendor/swagger-ui/swagger-ui-bundle.js",
            swagger_css_url="/ui/static/vendor/swagger-ui/swagger-ui.css",
            swagger_favicon_url="/ui/static/favicon.svg",
            swagger_ui_parameters={"validatorUrl": None},
        )
