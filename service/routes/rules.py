"""Rules: read, replace (validated; a bad file is refused and the old rules stay), test."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from trainguard.service.deps import ControllerDep, ReadDep, RulesDep
from trainguard.service.engine import simulate
from trainguard.service.errors import Invalid
from trainguard.service.rules import MAX_ACTIONS, MAX_JOBS, MAX_NODES, MAX_OVERRIDES, MAX_RULES, REMOVE_ALL_PARAM, RulesError
from trainguard.service.schemas import RulesTestRequest, nan_safe
from trainguard.protocol.wire import DesiredState

__all__ = ["router", "SimulationGate", "SIMULATIONS_RUNNING", "SIMULATIONS_WAITING", "MAX_EVALUATIONS", "MAX_RANK_REPORTS"]

router = APIRouter(prefix="/v1", tags=["rules"])


def _rules_body(ctl: Any) -> dict[str, Any]:
    return ctl.rules_meta | {"text": ctl.rules.text, "rules": ctl.rules.file.model_dump(mode="json")}


@router.get("/rules", summary="The active rules (YAML text and parsed)")
async def get_rules(ctl: ControllerDep, _: ReadDep) -> dict[str, Any]:
    return _rules_body(ctl)


@router.put(
    "/rules", summary="Replace the rules (body: YAML or JSON text)",
    description="Replaces every rule with the file in the body, once it validates (422 with every reason otherwise; "
    "the active rules stay). Parsing and validation run in a worker thread. A file holds at most "
    f"{MAX_RULES:,} rules, {MAX_ACTIONS} actions per rule, overrides for {MAX_JOBS:,} jobs, {MAX_OVERRIDES:,} overrides "
    f"in all and {MAX_NODES:,} YAML nodes with its aliases expanded. A body without rules is refused (it would remove "
    "every rule, the safety rules such as loss_nonfinite included): to turn a rule off set `enabled: false` on it; "
    f"to really remove every rule send `rules: []` with `?{REMOVE_ALL_PARAM}=true`.",
    openapi_extra={"requestBody": {"required": True, "content": {"application/yaml": {"schema": {"type": "string"}}}}},
)
async def put_rules(
    request: Request, ctl: ControllerDep, principal: RulesDep,
    remove_all: Annotated[bool, Query(alias=REMOVE_ALL_PARAM, description="Confirms a body with `rules: []`: every rule is removed.")] = False,
) -> dict[str, Any]:
    raw = await request.body()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise RulesError(["the body is not UTF-8 text"]) from None
    await ctl.put_rules(text, principal.actor, remove_all=remove_all)
    return _rules_body(ctl)


#: Simulations running at once (each in a worker thread); more callers wait, up to
#: :data:`SIMULATIONS_WAITING`, beyond which they are answered 429.
SIMULATIONS_RUNNING = 2
SIMULATIONS_WAITING = 8
#: Most rule evaluations one simulation may take (the job's enabled rules x the reports): a few
#: seconds of CPU. The built-in rules over 10,000 reports take 300,000.
MAX_EVALUATIONS = 500_000
#: Most rank values one simulation may replay (the reports x ``world_size``): the per-rank rules
#: read every rank of every report, about a microsecond each (a few seconds in all), and the
#: rank windows hold them. 152 reports of 32,768 ranks, 1,220 of 4,096, 10,000 of 500.
MAX_RANK_REPORTS = 5_000_000


@router.post(
    "/rules/test", summary="Replay reports through rules: alerts and desired states, no side effects",
    description=f"Runs in a worker thread, {SIMULATIONS_RUNNING} at a time; with {SIMULATIONS_WAITING} more waiting, "
    "further calls are answered 429 (retry later). Reports keep flowing meanwhile. One simulation evaluates at most "
    f"{MAX_EVALUATIONS:,} rules in all (the job's enabled rules x the reports) and {MAX_RANK_REPORTS:,} rank values "
    "(the reports x world_size, which may not exceed TRAINGUARD_MAX_WORLD_SIZE); beyond, 422 names the limit.",
    # (the body is parsed in the worker thread; service/openapi.py adds RulesTestRequest to the schemas)
    openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/RulesTestRequest"}}}}},
)
async def test_rules(request: Request, ctl: ControllerDep, _: RulesDep) -> Response:
    gate: SimulationGate = request.app.state.simulations
    raw = await request.body()
    async with gate:
        try:
            answer = await asyncio.to_thread(_simulate, ctl, raw)
        except ValidationError as e:
            raise RequestValidationError(e.errors(include_url=False, include_context=False, include_input=False)) from None
    return Response(answer, media_type="application/json")


def _simulate(ctl: Any, raw: bytes) -> bytes:
    """Parse, validate and replay (in a worker thread: none of it touches the controller's state)."""
    body = RulesTestRequest.model_validate_json(raw)
    limit = ctl.settings.max_world_size
    if body.world_size > limit:
        raise Invalid(f"world_size {body.world_size:,} exceeds TRAINGUARD_MAX_WORLD_SIZE={limit:,}: the controller "
                      "accepts no run that large")
    if len(body.reports) * body.world_size > MAX_RANK_REPORTS:
        raise Invalid(f"{len(body.reports):,} reports x world_size {body.world_size:,} is "
                      f"{len(body.reports) * body.world_size:,} rank values; a simulation takes at most "
                      f"{MAX_RANK_REPORTS:,} (send fewer reports)")
    rules = ctl.validate_rules(body.rules) if body.rules is not None else ctl.rules
    evaluations = len(rules.for_job(body.job)) * len(body.reports)
    if evaluations > MAX_EVALUATIONS:
        raise Invalid(f"{len(rules.for_job(body.job)):,} rules x {len(body.reports):,} reports is {evaluations:,} rule "
                      f"evaluations; a simulation takes at most {MAX_EVALUATIONS:,} (send fewer reports or rules)")
    steps = simulate(rules.for_job(body.job), body.reports, world_size=body.world_size, desired=body.desired,
                     capacity=ctl.settings.window_reports, rank_capacity=ctl.settings.rank_window_reports,
                     policy=rules.file.recovery)
    out = []
    for s in steps:
        out.append({
            "index": s.index, "step_last": s.step_last,
            "fired": [{"rule": f.finding.rule.name, "severity": f.finding.rule.severity, "summary": f.finding.summary,
                       "values": f.finding.values, "actions": [a.type for a in f.finding.rule.actions],
                       "generation": f.desired.generation if f.desired else None} for f in s.fired],
            "resolved": s.resolved,
            "suppressed": [{"rule": f.rule.name, "reason": why} for f, why in s.suppressed],
            "desired": s.desired.model_dump(),
            "recovery": [{"generation": d.generation, "reason": d.reason} for d in s.recovery],
        })
    final = steps[-1].desired if steps else (body.desired or DesiredState())
    return json.dumps(nan_safe({"steps": out, "desired": final.model_dump()})).encode()


class SimulationGate:
    """At most ``running`` holders at once and ``waiting`` callers queued; beyond: 429."""

    def __init__(self, running: int, waiting: int) -> None:
        self._sem = asyncio.Semaphore(running)
        self._limit = running + waiting
        self.inside = 0

    async def __aenter__(self) -> None:
        if self.inside >= self._limit:
            raise HTTPException(429, "too many rule simulations in progress; retry later", headers={"Retry-After": "1"})
        self.inside += 1
        try:
            await self._sem.acquire()
        except BaseException:
            self.inside -= 1
            raise

    async def __aexit__(self, *exc: object) -> None:
        self._sem.release()
        self.inside -= 1
