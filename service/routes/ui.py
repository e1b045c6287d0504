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
the charts use the vendored uPlot. The run page's actions are the command registry's operator
commands (``GET /ui/api/commands``, ``POST /ui/api/runs/{run}/{command}`` and its ``/preview``),
and ``DELETE /ui/api/runs/{run}`` (the API's ``DELETE /v1/runs/{run}``, with the same checks).
Sessions, sign-in limits and the request checks are in ``ui_sessions.py``; the reads' rows and the
live-update streams in ``ui_streams.py``.
"""

from __future__ import annotations

import json
import logging
import math
from importlib.resources import files
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Body, FastAPI, HTTPException, Query, Request, Response
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from trainguard.protocol.command_inputs import command_inputs, validation_message
from trainguard.protocol.base import Prose
from trainguard.protocol.commands import REGISTRY, CommandRefused, CommandSpec, apply_command
from trainguard.protocol.wire import MAX_INT
from trainguard.service.auth import ANONYMOUS, TokenTable
from trainguard.service.controller import Controller
from trainguard.service.errors import TooMany
from trainguard.service.operator_commands import applies_when
from trainguard.service.routes.ui_sessions import (
    COOKIE, CSRF_HEADER, AnySession, ConsoleSessions, LoginLimiter, ReadSession, Session, _check_origin, _live_session,
    _secure, _sessions, _set_cookie,
)
from trainguard.service.routes.ui_streams import (
    EVENTS_KEPT, StreamSnapshots, open_stream, run_detail, runs_rows, window_rows,
)
from trainguard.service.schemas import nan_safe

__all__ = ["router", "install", "ConsoleSessions", "LoginLimiter", "StreamSnapshots", "COOKIE", "CSRF_HEADER", "UI_DIR"]

log = logging.getLogger("trainguard.service.ui")

UI_DIR = Path(str(files("trainguard.service") / "ui"))
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
async def _alerts(ctl: Controller, run: str) -> list[dict[str, Any]]:
    return await ctl.records.alerts(state=None, run=run, limit=100, before=None)


@router.get("/ui/api/runs")
async def api_runs(request: Request, _: ReadSession) -> Response:
    return _json(runs_rows(_controller(request)))


@router.get("/ui/api/runs/{run}")
async def api_run(run: str, request: Request, _: ReadSession) -> Response:
    """A run's status, its window (reports and per-rank vectors), its recent alerts with their
    diagnoses, its incidents (onset, rungs, outcome; newest first) and its recent audit events."""
    ctl = _controller(request)
    st = ctl.get(run)
    alerts = await _alerts(ctl, run)
    events = (await ctl.records.events_newest(run=run, before=None, limit=EVENTS_KEPT))[::-1]
    return _json({"run": run_detail(st), "window": window_rows(st, 0), "alerts": alerts,
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
    limit: Annotated[int, Query(ge=1, le=1000)] = 200, run: Annotated[str | None, Query(max_length=128)] = None,
) -> Response:
    """The audit log of every run (or of the runs named ``run``, deleted ones included), newest
    first: ``limit`` events with ids below ``before``."""
    page = await _controller(request).records.events_newest(run=run, before=before, limit=limit)
    return _json({"events": page, "before": page[-1]["id"] if len(page) == limit else None})


# -- live updates (ui_streams.py) -------------------------------------------------------------------

@router.get("/ui/api/stream")
async def api_stream(request: Request, session: ReadSession, after: Annotated[int, Query(ge=0, le=MAX_INT)] = 0) -> StreamingResponse:
    return open_stream(request, session, None, 0, after)


@router.get("/ui/api/runs/{run}/stream")
async def api_run_stream(
    run: str, request: Request, session: ReadSession, seq: Annotated[int, Query(ge=0, le=MAX_INT)] = 0,
    after: Annotated[int, Query(ge=0, le=MAX_INT)] = 0,
) -> StreamingResponse:
    _controller(request).get(run)
    return open_stream(request, session, run, seq, after)



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


def _action(command: str, session: Session, body: dict[str, Any] | None) -> tuple[CommandSpec, Any, bool]:
    """The action ``command`` (404 unknown; 403 without its scope), its body validated by its
    request model (422 with the model's message), and the body's ``on_restart`` beside its fields
    (queue it for a finished run, as the API's ``on_restart=true``)."""
    spec = _ACTIONS.get(command)
    if spec is None:
        raise HTTPException(404, f"unknown action {command!r}; known: {', '.join(_ACTIONS)}")
    if spec.scope not in session.principal.scopes:
        raise HTTPException(403, f"this operator token lacks the '{spec.scope}' scope")
    fields = dict(body or {})
    on_restart = fields.pop("on_restart", False)
    if not isinstance(on_restart, bool):
        raise HTTPException(422, f"on_restart is true or false, not {json.dumps(on_restart)[:80]}")
    try:
        return spec, spec.request.model_validate(fields), on_restart
    except ValidationError as e:
        raise HTTPException(422, validation_message(e)) from None


@router.post("/ui/api/runs/{run}/{command}/preview")
async def api_preview(run: str, command: str, request: Request, session: AnySession,
                      body: Annotated[dict[str, Any] | None, Body()] = None) -> Response:
    """What the action would change in the run's desired state now (``changes``: field, now,
    after; the generation last when anything changes) and the note it would record; 409 when the
    controller would refuse it, with the reason (a finished run's without ``on_restart``), and when
    it would apply (``applies``). Nothing is changed."""
    spec, params, on_restart = _action(command, session, body)
    st = _controller(request).get(run)
    applies = applies_when(st, spec.name, on_restart)
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
    return _json({"command": spec.name, "changes": changes, "note": note, "applies": applies})


@router.post("/ui/api/runs/{run}/{command}")
async def api_command(run: str, command: str, request: Request, session: AnySession,
                      body: Annotated[dict[str, Any] | None, Body()] = None) -> Response:
    """Any action of ``GET /ui/api/commands`` (body: its fields, ``reason`` and ``on_restart``),
    as the signed-in operator."""
    spec, params, on_restart = _action(command, session, body)
    actor = session.principal.actor
    status, answer = await _controller(request).command(
        run, spec.name, params=params, reason=params.reason or f"{command} from the console by {actor}", actor=actor,
        source="operator", on_restart=on_restart)
    return Response(answer, status_code=status, media_type="application/json")


class Deletion(BaseModel):
    """The body of a run's deletion from the console."""

    model_config = ConfigDict(extra="forbid")
    force: StrictBool = False
    reason: Prose = Field(default="", max_length=2000)


@router.delete("/ui/api/runs/{run}")
async def api_delete_run(run: str, request: Request, session: AnySession,
                         body: Annotated[dict[str, Any] | None, Body()] = None) -> Response:
    """Delete the run as ``DELETE /v1/runs/{run}`` does (the ``command`` scope; body: ``force``,
    ``reason``): 404 for an unknown run, 409 with the controller's reason for a live one unless
    ``force``."""
    if "command" not in session.principal.scopes:
        raise HTTPException(403, "this operator token lacks the 'command' scope")
    try:
        deletion = Deletion.model_validate(body or {})
    except ValidationError as e:
        raise HTTPException(422, validation_message(e)) from None
    actor = session.principal.actor
    return _json(await _controller(request).delete_run(
        run, actor=actor, force=deletion.force, reason=deletion.reason or f"deleted from the console by {actor}"))


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
