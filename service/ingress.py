"""The hot path, ``POST /v1/runs/{run}/reports``, as a plain ASGI middleware.

Every training run posts a report per interval, so this one endpoint carries nearly all of the
controller's traffic. Through Starlette's router and FastAPI's dependency solving a report cost
~540 µs of CPU in all, ~190 µs of it in the framework (bench/controller_ingest.py); here a
well-formed, authorised report goes straight from the body to :meth:`Controller.ingest_json` (which
the route calls too: parsing, ingesting and timing have one source) and its
answer, which is already JSON bytes, straight to the server.

Everything else is handed to the FastAPI app unchanged, so the answers stay exactly those of the
documented route (``service.routes.runs.post_report``, which also keeps the endpoint in the
OpenAPI schema): other paths and methods; run names the route would refuse; a missing, unknown or
under-scoped token (401/403, checked before the body is read); and a body that does not validate
as a :class:`~trainguard.protocol.wire.Report` (the route parses it again and answers FastAPI's 422). Errors
the controller raises while ingesting (404, 403, 409, 422, 503) are answered here the way the
app's exception handlers answer them.
"""

from __future__ import annotations

from typing import Any, Callable

from pydantic import ValidationError
from starlette.responses import JSONResponse

from trainguard.service.auth import AGENT_SCOPE, TokenTable, authorization_header
from trainguard.service.controller import Controller
from trainguard.service.limits import PRINCIPAL_KEY, read_body, replay
from trainguard.protocol.wire import API_PREFIX

__all__ = ["ReportIngress", "MAX_RUN_NAME"]

#: Longest run name in a report URL (``service.routes.runs.RunPath`` answers 422 beyond it).
MAX_RUN_NAME = 128
_PREFIX = f"{API_PREFIX}/runs/"
_SUFFIX = "/reports"
_HEADERS = [(b"content-type", b"application/json")]


class ReportIngress:
    """Answer well-formed report posts directly; pass everything else to ``app``.

    ``errors`` maps the controller's exception types to HTTP status codes (the app's own
    handlers' table), ``tokens`` authenticates callers.
    """

    def __init__(self, app: Any, *, controller: Controller, tokens: TokenTable, errors: dict[type[Exception], int]) -> None:
        self.app = app
        self.controller = controller
        self.tokens = tokens
        self.errors = errors
        self._known = tuple(errors)

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Any], send: Callable[[Any], Any]) -> None:
        run = self._run(scope)
        if run is None:
            await self.app(scope, receive, send)
            return
        principal = scope.get(PRINCIPAL_KEY)
        if principal is None:
            principal = self.tokens.authenticate(authorization_header(scope))
        if principal is None or AGENT_SCOPE not in principal.scopes:
            await self.app(scope, receive, send)  # the route's dependency answers 401/403
            return
        body = await read_body(receive)  # (bounded: BodyLimit runs first)
        if body is None:
            return  # the client went away
        try:
            answer = await self.controller.ingest_json(run, body, principal)
        except ValidationError:
            await self.app(scope, replay(body, receive), send)  # the route answers (and counts) the 422
            return
        except self._known as e:
            status = next(code for cls, code in self.errors.items() if isinstance(e, cls))
            await JSONResponse({"detail": str(e)}, status_code=status)(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"%d" % len(answer)), *_HEADERS]})
        await send({"type": "http.response.body", "body": answer})

    @staticmethod
    def _run(scope: dict[str, Any]) -> str | None:
        """The run of a report post this middleware answers, else ``None``."""
        if scope["type"] != "http" or scope["method"] != "POST" or scope.get("root_path"):
            return None
        path: str = scope["path"]
        if not (path.startswith(_PREFIX) and path.endswith(_SUFFIX)):
            return None
        run = path[len(_PREFIX) : -len(_SUFFIX)]
        if not run or len(run) > MAX_RUN_NAME or "/" in run:
            return None
        return run
