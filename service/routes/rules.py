"""Rules: read, replace (validated; a bad file is refused and the old rules stay), test."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from trainguard.service.deps import ControllerDep, ReadDep, RulesDep
from trainguard.service.engine import simulate
from trainguard.service.rules import RulesError
from trainguard.service.schemas import RulesTestRequest, nan_safe
from trainguard.protocol.wire import DesiredState

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["rules"])


def _rules_body(ctl: Any) -> dict[str, Any]:
    return ctl.rules_meta | {"text": ctl.rules.text, "rules": ctl.rules.file.model_dump(mode="json")}


@router.get("/rules", summary="The active rules (YAML text and parsed)")
async def get_rules(ctl: ControllerDep, _: ReadDep) -> dict[str, Any]:
    return _rules_body(ctl)


@router.put(
    "/rules", summary="Replace the rules (body: YAML or JSON text)",
    openapi_extra={"requestBody": {"required": True, "content": {"application/yaml": {"schema": {"type": "string"}}}}},
)
async def put_rules(request: Request, ctl: ControllerDep, principal: RulesDep) -> dict[str, Any]:
    raw = await request.body()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise RulesError(["the body is not UTF-8 text"]) from None
    await ctl.put_rules(text, principal.actor)
    return _rules_body(ctl)


@router.post("/rules/test", summary="Replay reports through rules: alerts and desired states, no side effects")
async def test_rules(body: RulesTestRequest, ctl: ControllerDep, _: ReadDep) -> dict[str, Any]:
    rules = ctl.validate_rules(body.rules) if body.rules is not None else ctl.rules
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
    return nan_safe({"steps": out, "desired": final.model_dump()})
