"""The operator console at ``/ui``: pages, sign-in, and the JSON and event-stream endpoints its
scripts call; also the API docs page (``/docs``) with locally served assets.

Sign-in takes the same operator tokens and scopes as the API: ``POST /ui/login`` with the token in
a JSON body answers a session cookie (HttpOnly, SameSite=Strict, path ``/ui``) and a CSRF token; the
token itself never appears in a URL, a cookie or a log line. Every console request is authorised
by the session (401 without one, 403 without the scope); every state-changing request also needs
the session's CSRF token in ``X-CSRF-Token`` (403 otherwise) and, when the browser sends an
``Origin``, the controller's own. Without configured tokens (the controller then binds to loopback
only) the console opens an anonymous session by itself: there is nothing to sign in with.

Sessions live in the controller's memory (bounded, 12 hours each): a restart signs everyone out.
The pages are one HTML shell and plain JavaScript modules under ``service/ui`` (no build step);
the charts use the vendored uPlot.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import time
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

from trainguard.protocol.wire import MAX_INT, CommandRequest, LrScaleRequest
from trainguard.service.auth import ANONYMOUS, Principal, TokenTable
from trainguard.service.controller import Controller
from trainguard.service.schemas import nan_safe

__all__ = ["router", "install", "ConsoleSessions", "COOKIE", "CSRF_HEADER"]

UI_DIR = Path(str(files("trainguard.service") / "ui"))
COOKIE = "trainguard_session"
CSRF_HEADER = "X-CSRF-Token"
_SESSION_TTL_S = 12 * 3600.0
_MAX_SESSIONS = 1024
_TICK_S = 0.5
_RUNS_EVERY_S = 1.0
_HEARTBEAT_S = 15.0
_EVENTS_KEPT = 500
#: The console's action paths (the API's) and the commands they send.
_COMMANDS = {"pause": "pause", "resume": "resume", "checkpoint": "checkpoint", "stop": "stop", "lr-scale": "lr_scale"}
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


class ConsoleSessions:
    """Signed-in browsers: session id -> principal and CSRF token. Bounded: beyond ``capacity``
    the oldest session is dropped; a session expires ``ttl_s`` after sign-in."""

    def __init__(self, *, ttl_s: float = _SESSION_TTL_S, capacity: int = _MAX_SESSIONS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0 or capacity < 1:
            raise ValueError("ttl_s must be > 0 and capacity >= 1")
        self.ttl_s, self.capacity, self.clock = ttl_s, capacity, clock
        self._by_id: OrderedDict[str, Session] = OrderedDict()

    def open(self, principal: Principal) -> tuple[str, Session]:
        while len(self._by_id) >= self.capacity:
            self._by_id.popitem(last=False)
        sid = secrets.token_urlsafe(32)
        session = self._by_id[sid] = Session(principal, secrets.token_urlsafe(32), self.clock() + self.ttl_s)
        return sid, session

    def get(self, sid: str | None) -> Session | None:
        if not sid:
            return None
        session = self._by_id.get(sid)
        if session is not None and session.expires <= self.clock():
            del self._by_id[sid]
            return None
        return session

    def close(self, sid: str | None) -> None:
        if sid:
            self._by_id.pop(sid, None)

    def __len__(self) -> int:
        return len(self._by_id)


def _sessions(request: Request) -> ConsoleSessions:
    return request.app.state.console_sessions


def _secure(request: Request) -> bool:
    """Whether the browser reaches the console over https (directly, or through a TLS proxy
    whose public address is TRAINGUARD_EXTERNAL_URL)."""
    return request.url.scheme == "https" or request.app.state.settings.external_url.startswith("https://")


def _set_cookie(response: Response, request: Request, sid: str, ttl_s: float) -> None:
    response.set_cookie(COOKIE, sid, max_age=int(ttl_s), path="/ui", httponly=True, samesite="strict",
                        secure=_secure(request))


def _check_origin(request: Request) -> None:
    """Refuse a state-changing request whose ``Origin`` is another site's (SameSite=Strict already
    keeps the cookie off cross-site requests; this also covers browsers that ignore it)."""
    origin = request.headers.get("origin")
    if origin is None:
        return
    allowed = {request.headers.get("host", "")}
    external = request.app.state.settings.external_url
    if external:  # behind a proxy that rewrites Host, the public address the browser uses
        allowed.add(urlsplit(external).netloc)
    if urlsplit(origin).netloc not in allowed:
        raise HTTPException(403, "cross-origin request refused (behind a proxy, set TRAINGUARD_EXTERNAL_URL to the public address)")


def _session_dep(scope: str | None, *, csrf: bool) -> Callable[[Request], Awaitable[Session]]:
    async def dep(request: Request) -> Session:
        session = _sessions(request).get(request.cookies.get(COOKIE))
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
CommandSession = Annotated[Session, Depends(_session_dep("command", csrf=True))]
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
    session = sessions.get(request.cookies.get(COOKIE))
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
    principal = tokens.authenticate(f"Bearer {body.token}")
    if principal is None:
        raise HTTPException(401, "unknown token")
    if principal.kind == "agent":
        raise HTTPException(403, "agent tokens cannot sign in to the console: use an operator token")
    sessions = _sessions(request)
    sessions.close(request.cookies.get(COOKIE))
    sid, session = sessions.open(principal)
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


async def _updates(ctl: Controller, run: str | None, seq: int, after: int) -> AsyncIterator[bytes]:
    """Server-Sent Events for the console. With ``run``: ``report`` (new window rows after report
    ``seq``), ``audit`` (the run's audit events after id ``after``) and ``run`` (its status, when it
    changed). Without: ``runs`` (the runs list, when it changed) and ``audit`` (every run's events)."""
    hub = ctl.events_hub
    queue = hub.subscribe()  # before the replay, so nothing falls between the two
    try:
        yield b"retry: 2000\n\n"
        if after:
            for ev in await _events_after(ctl, run, after):
                yield _sse("audit", ev, ev["id"])
                after = ev["id"]
        last_state = ""
        quiet = 0.0
        # the runs list (every run's status) is compared at most every _RUNS_EVERY_S; one run's
        # status and new reports every tick
        loop = asyncio.get_running_loop()
        next_runs = 0.0
        while True:
            state: Any = None
            if run is not None:
                st = ctl.get(run)
                if st.window.count > seq:
                    update = _window(st, seq)
                    seq = st.window.count
                    if update["rows"] or update["ranks"]:
                        yield _sse("report", update)
                state = _detail(st)
            elif loop.time() >= next_runs:
                next_runs = loop.time() + _RUNS_EVERY_S
                state = _runs(ctl)
            text = json.dumps(nan_safe(state), sort_keys=True) if state is not None else last_state
            if text != last_state:
                last_state = text
                yield _sse("run" if run is not None else "runs", state)
            try:
                ev = await asyncio.wait_for(queue.get(), _TICK_S)
            except TimeoutError:
                if not hub.is_subscribed(queue):
                    return  # dropped as too slow: the page reconnects from its cursors
                quiet += _TICK_S
                if quiet >= _HEARTBEAT_S:
                    quiet = 0.0
                    yield b": keep-alive\n\n"
                continue
            if ev is None:
                return  # the controller is shutting down
            if ev["id"] > after and (run is None or ev["run"] == run):
                after = ev["id"]
                yield _sse("audit", ev, ev["id"])
    finally:
        hub.unsubscribe(queue)


def _stream(body: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.get("/ui/api/stream")
async def api_stream(request: Request, _: ReadSession, after: Annotated[int, Query(ge=0, le=MAX_INT)] = 0) -> StreamingResponse:
    return _stream(_updates(_controller(request), None, 0, after))


@router.get("/ui/api/runs/{run}/stream")
async def api_run_stream(
    run: str, request: Request, _: ReadSession, seq: Annotated[int, Query(ge=0, le=MAX_INT)] = 0,
    after: Annotated[int, Query(ge=0, le=MAX_INT)] = 0,
) -> StreamingResponse:
    ctl = _controller(request)
    ctl.get(run)
    return _stream(_updates(ctl, run, seq, after))


# -- actions ------------------------------------------------------------------------------------------
@router.post("/ui/api/runs/{run}/{command}")
async def api_command(run: str, command: str, request: Request, session: CommandSession,
                      body: Annotated[dict[str, Any] | None, Body()] = None) -> Response:
    """Pause, resume, checkpoint, stop (body ``{"reason"}``) or lr-scale (``{"scale", "reason"}``),
    as the signed-in operator."""
    if command not in _COMMANDS:
        raise HTTPException(404, f"unknown action {command!r}; known: {', '.join(_COMMANDS)}")
    try:
        req = (LrScaleRequest if command == "lr-scale" else CommandRequest).model_validate(body or {})
    except ValidationError as e:
        raise HTTPException(422, "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())) from None
    actor = session.principal.actor
    status, answer = await _controller(request).command(
        run, _COMMANDS[command], reason=req.reason or f"{command} from the console by {actor}", actor=actor,
        scale=getattr(req, "scale", None))
    return Response(answer, status_code=status, media_type="application/json")


# -- the app ------------------------------------------------------------------------------------------
def install(app: FastAPI) -> None:
    """Add the console (routes, static assets, sessions) and the local API docs page to ``app``
    (built with ``docs_url=None``)."""
    app.state.console_sessions = ConsoleSessions()
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
