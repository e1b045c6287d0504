"""The FastAPI application factory."""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

import httpx
from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry

from trainguard.service.auth import TokenTable
from trainguard.service.config import Settings
from trainguard.service.controller import Controller
from trainguard.service.errors import Conflict, Forbidden, Invalid, NotFound, TooMany
from trainguard.service import openapi
from trainguard.service.ingress import ReportIngress
from trainguard.service.json_text import JsonText
from trainguard.service.limits import Authenticate, BodyLimit
from trainguard.service.metrics import ControllerMetrics
from trainguard.service.routes import alerts, rules, runs, system, tokens as token_routes, ui, webhooks
from trainguard.service.rules import RulesError
from trainguard.service.security_headers import NoSniff
from trainguard.service.schemas import NOT_REPEATED, SECRET_FIELDS, RulesTestRequest, nan_safe, validation_summary
from trainguard.service.standby import Standby, StandbyGate
from trainguard.service.startup import LoadingGate, StartupLoader
from trainguard.service.store import GroupCommitStore, StoreError, open_store, shown_db
from trainguard.service.webhooks import WebhookDeliverer
from trainguard.protocol.wire import Report

__all__ = ["create_app"]

#: Longest refused value a 422 repeats (JSON characters); a longer one is cut, with its length.
ECHO_LIMIT = 512
#: Most problems a 422 lists (its detail says how many there were): 900 bad keys made a 220 KB answer.
ERRORS_SHOWN = 20


def _bounded_input(error: dict) -> dict:
    """The error with its ``input`` cut to ``ECHO_LIMIT`` characters of JSON: a refused value can
    be megabytes (a report's packed per-rank vector), and the answer must not repeat it. A secret
    (``SECRET_FIELDS``, refused itself or inside a refused object) is not repeated at all."""
    if "input" not in error:
        return error
    if SECRET_FIELDS.intersection(k for k in error["loc"] if isinstance(k, str)):
        return dict(error, input=NOT_REPEATED)
    if isinstance(error["input"], dict) and SECRET_FIELDS.intersection(error["input"]):
        error = dict(error, input={k: NOT_REPEATED if k in SECRET_FIELDS else v for k, v in error["input"].items()})
    text = json.dumps(error["input"])
    if len(text) > ECHO_LIMIT:
        error = dict(error, input=f"{text[:ECHO_LIMIT]}... ({len(text):,} characters in all)")
    return error


_STATUS = {NotFound: 404, Conflict: 409, Forbidden: 403, Invalid: 422, TooMany: 429, StoreError: 503}


def create_app(
    settings: Settings | None = None, *, store: GroupCommitStore | None = None, clock: Callable[[], float] | None = None,
    transport: httpx.AsyncBaseTransport | None = None, registry: CollectorRegistry | None = None,
) -> FastAPI:
    """Build the controller app. Injected: the store (default: ``settings.db``, a SQLite file or a PostgreSQL URL), the
    clock (default ``time.time``), the webhooks' HTTP transport, the metrics registry."""
    settings = settings or Settings()
    clock = clock or time.time
    tokens = TokenTable(settings.operator_tokens, settings.agent_tokens, clock=clock)
    store = store or open_store(settings.db)
    holder: dict[str, Controller] = {}

    def snapshot() -> dict[str, Any] | None:  # the runs' gauges once the runs are read back
        ctl = holder.get("ctl")
        return ctl.metrics_snapshot() if ctl is not None and ctl.startup is not None and ctl.startup.ready else None

    metrics = ControllerMetrics(registry or CollectorRegistry(), snapshot)
    deliverer = WebhookDeliverer(
        store, metrics, clock=clock, timeout_s=settings.webhook_timeout_s, max_attempts=settings.webhook_max_attempts,
        backoff_s=settings.webhook_backoff_s, backoff_max_s=settings.webhook_backoff_max_s, transport=transport,
    )
    controller = holder["ctl"] = Controller(settings, store, metrics, clock=clock, deliverer=deliverer)
    controller.reserved_runs = tokens.reserved_runs
    controller.tokens = tokens
    # The runs are read back in the lifespan, while the app answers (service/startup.py).
    loader = controller.startup = StartupLoader(controller, wait_runs=settings.startup_wait_runs)
    standby = _standby_or_load(controller, store, loader, settings)

    app = FastAPI(
        title="trainguard controller", version="0.1.0", lifespan=_lifespan(controller, loader, standby),
        docs_url=None, redoc_url=None,
        description="Runs, reports, rules, alerts and desired state of training runs. Agents register runs and post "
        "reports; operators read status and command runs; rules and Alertmanager act too.",
    )
    app.state.controller = controller
    app.state.startup = loader
    app.state.tokens = tokens
    app.state.settings = settings
    app.state.simulations = rules.SimulationGate(rules.SIMULATIONS_RUNNING, rules.SIMULATIONS_WAITING)
    app.state.event_streams = alerts.StreamSlots()
    for module in (runs, alerts, rules, webhooks, token_routes, system):
        app.include_router(module.router)
    ui.install(app)  # the operator console at /ui and the API docs at /docs, every asset served locally

    _install_error_handlers(app)
    _install_middleware(app, controller, tokens, loader, settings, standby)
    return app


def _standby_or_load(controller: Controller, store: GroupCommitStore, loader: StartupLoader,
                     settings: Settings) -> Standby | None:
    """Read the rules and tokens now, or, for a store shared with another controller (PostgreSQL),
    a standby that reads them and the runs once the writer lease is ours (listening meanwhile)."""

    def load() -> None:
        controller.load_rules()
        controller.load_tokens()

    if not store.needs_lease:
        load()
        return None

    async def become_active() -> None:
        await asyncio.to_thread(load)
        await loader.start()

    return Standby(take_lease=store.take_lease, become_active=become_active, database=shown_db(settings.db))


def _install_error_handlers(app: FastAPI) -> None:
    """The API's errors as JSON: a product error with its status (``_STATUS``), invalid rules
    with their reasons, and a request validation error with its summary (never the raw input)."""

    async def known_error(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=_STATUS[type(exc)])

    for exc_type in _STATUS:
        app.add_exception_handler(exc_type, known_error)

    async def rules_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RulesError)
        return JSONResponse({"detail": "invalid rules; the active rules are unchanged", "reasons": exc.reasons}, status_code=422)

    app.add_exception_handler(RulesError, rules_error)

    async def request_invalid(request: Request, exc: Exception) -> Response:
        # FastAPI's own handler echoes the input with ensure_ascii=False, so a body holding an
        # unpaired surrogate escape ("\\ud800", which Python's json accepts) made the 422 itself
        # fail to encode: a 500. Escaped JSON encodes every string.
        assert isinstance(exc, RequestValidationError)
        every = exc.errors()
        # (a body sent as other than JSON is its raw bytes, which need not be UTF-8: shown replaced)
        shown = jsonable_encoder(every[:ERRORS_SHOWN], custom_encoder={bytes: lambda b: b.decode("utf-8", "replace")})
        errors = [_bounded_input(e) for e in shown]
        detail = validation_summary(errors, total=len(every))
        # (NaN and Infinity as the wire's strings: a bare NaN token is not JSON a browser or Go parses)
        body = json.dumps(nan_safe({"detail": detail, "errors": errors}), allow_nan=False).encode()
        return Response(body, status_code=422, media_type="application/json")

    app.add_exception_handler(RequestValidationError, request_invalid)


def _install_middleware(app: FastAPI, controller: Controller, tokens: TokenTable, loader: StartupLoader,
                        settings: Settings, standby: Standby | None) -> None:
    """The request path, outermost last: the nosniff header, the standby gate, authentication, the
    loading gate, the body limit, report ingress (and the OpenAPI document of every status)."""
    # Added first, so it runs inside BodyLimit: report bodies are size-checked before it reads them.
    openapi.install(app, models=(Report, RulesTestRequest))  # every status and the one error shape (service/openapi.py)
    app.add_middleware(JsonText)  # inside ReportIngress: reports are parsed by pydantic (it refuses lone surrogates)
    app.add_middleware(ReportIngress, controller=controller, tokens=tokens, errors=_STATUS)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, max_world_size=settings.max_world_size,
                       world_size_of=lambda run: (st := controller.runs.get(run)) and st.world_size)
    app.add_middleware(LoadingGate, loader=loader)  # 503 'loading' until the runs are read back
    app.add_middleware(Authenticate, tokens=tokens)  # no body is read before the token is known
    if standby is not None:
        app.add_middleware(StandbyGate, standby=standby)  # a standby reads nothing
    app.add_middleware(NoSniff)  # outermost: every answer, the gates' included


def _lifespan(controller: Controller, loader: StartupLoader, standby: Standby | None) -> Callable[[FastAPI], Any]:
    """Start reading the runs back (or standing by for the lease); on shutdown stop both, and the
    controller unless a standby never became active."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if standby is not None:
            await standby.start()
        else:
            await loader.start()
        try:
            yield
        finally:
            await loader.stop()
            if standby is None or await standby.stop():
                await controller.stop()

    return lifespan
