"""Runs: registration, reports, desired state and acks (agent); status and commands (operator)."""

from __future__ import annotations

import hashlib
import inspect
import json
from typing import Annotated

from fastapi import APIRouter, Header, HTTPException, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from trainguard.service.controller import Controller
from trainguard.service.auth import Principal
from trainguard.service.deps import AgentDep, CommandDep, ControllerDep, PollDep, ReadDep, scope_dep
from trainguard.service.slots import CONNECTIONS_KEPT_FREE, POLLS_PER_OPERATOR_TOKEN, POLLS_PER_RUN
from trainguard.service.schemas import AckResult, CommandResult, FinishResult, IncidentList, RunDeleted, nan_safe
from trainguard.protocol.base import Prose
from trainguard.protocol.commands import REGISTRY, CommandRequest, CommandSpec
from trainguard.protocol.wire import (
    Ack, DesiredState, MemoryReport, PreflightResult, QuarantineReport, ReportAccepted, RunFinished, RunRegistered, RunRegistration,
)

__all__ = ["router", "command_route"]

router = APIRouter(prefix="/v1", tags=["runs"])
RunPath = Annotated[str, Path(min_length=1, max_length=128)]
IdemKey = Annotated[str | None, Header(alias="Idempotency-Key", max_length=200)]
OnRestart = Annotated[bool, Query(description="Queue the command for a finished run: it applies when a job registers "
                                  "the run's name again (a job restarted from a checkpoint). Without it a finished run "
                                  "refuses a command (409).")]
_JSON = "application/json"


def _validation_error(e: ValidationError) -> RequestValidationError:
    return RequestValidationError(e.errors(include_url=False, include_context=False, include_input=False))


@router.post("/runs", response_model=RunRegistered, summary="Register or re-register a run (agent)")
async def register(reg: RunRegistration, ctl: ControllerDep, principal: AgentDep) -> RunRegistered:
    return await ctl.register(reg, principal)


@router.post(
    "/runs/{run}/reports", response_model=ReportAccepted, summary="Post one report (agent); answers the desired state",
    openapi_extra={"requestBody": {"required": True, "content": {_JSON: {"schema": {"$ref": "#/components/schemas/Report"}}}}},
)
async def post_report(run: RunPath, request: Request, principal: AgentDep) -> Response:
    # Well-formed reports with a valid token are answered by service.ingress.ReportIngress before
    # they get here; this route documents the endpoint and answers everything it refuses.
    ctl: Controller = request.app.state.controller
    try:
        answer = await ctl.ingest_json(run, await request.body(), principal)
    except ValidationError as e:
        ctl.metrics.rejected.labels("invalid").inc()
        raise _validation_error(e) from None
    return Response(answer, media_type=_JSON)


@router.get("/runs/{run}/desired", response_model=DesiredState, summary="Long-poll the desired state (agent)",
            description=f"At most {POLLS_PER_RUN} long-polls of one run with one token wait at once (a run's leader "
            f"holds one), {POLLS_PER_OPERATOR_TOKEN} of one operator token, and in all every connection but "
            f"{CONNECTIONS_KEPT_FREE} (429 beyond, naming the limit).")
async def desired(
    run: RunPath, request: Request, ctl: ControllerDep, principal: PollDep,
    after: Annotated[int, Query(ge=-1, description="Answer once the generation exceeds this (-1: at once).")] = -1,
    wait: Annotated[float, Query(ge=0, le=3600, description="Longest wait in seconds (capped by the server).")] = 0.0,
) -> Response:
    answer = await ctl.wait_desired(run, after, wait, principal)
    if not request.app.state.tokens.is_live(principal):  # revoked or expired while it waited
        raise HTTPException(401, "the bearer token was revoked or expired", headers={"WWW-Authenticate": "Bearer"})
    return Response(answer, media_type=_JSON)


@router.post("/runs/{run}/acks", response_model=AckResult, summary="Every rank applied a generation (agent)")
async def post_ack(run: RunPath, ack: Ack, ctl: ControllerDep, principal: AgentDep) -> AckResult:
    return AckResult(**await ctl.ack(run, ack, principal))


@router.post(
    "/runs/{run}/finish", response_model=FinishResult, summary="The run ended (agent): it is no longer expected to report",
    description="Sent by the leader's agent from close(). The run's status becomes 'finished', its firing absence alert "
    "resolves and the absence rules skip it until it registers again (a restarted job). A repeat answers the first "
    "finish with changed=false.",
)
async def finish(run: RunPath, body: RunFinished, ctl: ControllerDep, principal: AgentDep) -> FinishResult:
    return FinishResult(**await ctl.finish(run, body, principal))


@router.post("/runs/{run}/preflight", summary="The run's pre-flight checks (agent), shown in its status")
async def post_preflight(run: RunPath, body: PreflightResult, ctl: ControllerDep, principal: AgentDep) -> dict:
    return await ctl.preflight(run, body, principal)


@router.post("/runs/{run}/memory-report", summary="A memory trace's result (agent), shown in the run's status and alert")
async def post_memory_report(run: RunPath, body: MemoryReport, ctl: ControllerDep, principal: AgentDep) -> dict:
    return await ctl.memory_report(run, body, principal)


@router.post("/runs/{run}/quarantine", summary="The samples a data skip left out (agent), named on the data incident")
async def post_quarantine(run: RunPath, body: QuarantineReport, ctl: ControllerDep, principal: AgentDep) -> dict:
    return await ctl.quarantine(run, body, principal)


@router.get("/runs", summary="List runs")
async def list_runs(ctl: ControllerDep, _: ReadDep, job: str | None = None, status: str | None = None) -> list[dict]:
    out = [st.summary() for st in ctl.runs.values() if (job is None or st.job == job)]
    return [r for r in out if status is None or r["status"] == status]


@router.get("/runs/{run}/incidents", summary="A run's incidents, newest first: onset, cause and evidence, rungs, outcome",
            responses={200: {"model": IncidentList}})
async def get_incidents(run: RunPath, ctl: ControllerDep, _: ReadDep) -> Response:
    return Response(json.dumps(nan_safe({"run": run} | ctl.get(run).incidents())), media_type=_JSON)


@router.get("/runs/{run}", summary="A run's status, last values, desired/applied generation, firing alerts")
async def get_run(run: RunPath, ctl: ControllerDep, _: ReadDep) -> Response:
    return Response(json.dumps(nan_safe(ctl.get(run).detail())), media_type=_JSON)


@router.delete(
    "/runs/{run}", response_model=RunDeleted, summary="Delete a run (operator): out of the controller and its limits",
    description="The run leaves the controller's memory, its limits (TRAINGUARD_MAX_RUNS, the per-token limit) and "
    "the run list; its reports are deleted in the background and its firing alerts resolve; its audit events (a "
    "'deleted' event among them) and alerts are kept. The name may be registered again, as a new run. A run still "
    "live (paused, or reporting within its job's silence limit, and neither finished nor stopped) is refused with 409 "
    "unless force=true (an agent still running registers it again). Finished and long-silent runs are also removed "
    "automatically once older than the report retention (docs/controller.md).",
)
async def delete_run(
    run: RunPath, ctl: ControllerDep, principal: CommandDep,
    force: Annotated[bool, Query(description="Delete a live run too.")] = False,
    reason: Annotated[Prose, Query(max_length=2000, description="Why (recorded in the audit log).")] = "",
) -> RunDeleted:
    return RunDeleted(**await ctl.delete_run(run, actor=principal.actor, force=force, reason=reason))


def _optional(request: type[CommandRequest]) -> bool:
    """Whether a command's body may be left out (every field has a default that validates)."""
    try:
        request()
    except ValidationError:
        return False
    return True


def command_route(spec: CommandSpec, on: APIRouter) -> None:
    """Add ``POST /runs/{run}/<url>`` of one operator command to ``on``: its body is the
    command's ``request`` (optional when its defaults validate), its scope the command's."""
    optional = _optional(spec.request)

    async def handler(run: str, ctl: Controller, principal: Principal, idempotency_key: str | None = None,
                      body: CommandRequest | None = None, on_restart: bool = False) -> Response:
        body = body if body is not None else spec.request()
        idem = None
        if idempotency_key:
            request = b"%s\x00%s\x00%s" % (spec.name.encode(), run.encode(), body.model_dump_json().encode())
            request += b"\x00on_restart" if on_restart else b""  # (a key stored before on_restart keeps its digest)
            idem = (principal.actor, idempotency_key, hashlib.sha256(request).hexdigest())
        status, answer = await ctl.command(run, spec.name, params=body, reason=body.reason, actor=principal.actor,
                                           idempotency=idem, on_restart=on_restart)
        return Response(answer, status_code=status, media_type=_JSON)

    P = inspect.Parameter
    handler.__signature__ = inspect.Signature([  # type: ignore[attr-defined]
        P("run", P.KEYWORD_ONLY, annotation=RunPath),
        P("ctl", P.KEYWORD_ONLY, annotation=ControllerDep),
        P("principal", P.KEYWORD_ONLY, annotation=scope_dep(spec.scope)),
        P("idempotency_key", P.KEYWORD_ONLY, annotation=IdemKey, default=None),
        P("body", P.KEYWORD_ONLY, annotation=spec.request | None if optional else spec.request,
          default=None if optional else P.empty),
        P("on_restart", P.KEYWORD_ONLY, annotation=OnRestart, default=False),
    ], return_annotation=Response)
    on.add_api_route(f"/runs/{{run}}/{spec.url}", handler, methods=["POST"], response_model=CommandResult,
                     summary=spec.summary, name=f"command_{spec.name}", tags=["commands"])


for _spec in REGISTRY:  # every operator command of the registry: a new one gets its route here
    if _spec.operator:
        command_route(_spec, router)
