"""The operator commands' routes (``service/routes/runs.py``), derived from the command registry:
each of the four optimizer commands through ``POST /v1/runs/{run}/<command>`` sets its field of
the desired state (422 with the reason for a body out of bounds, 409 for a command the run
refuses); the OpenAPI document lists one route per operator command of the registry, and a new
command gets its route without the routes being edited."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import APIRouter, FastAPI
from pydantic import Field

from trainguard.protocol.commands import (
    BY_NAME, MAX_GRAD_CLIP, MOMENTUM_SCALE_MAX, REGISTRY, WEIGHT_DECAY_SCALE_MAX, Change, CommandRequest, CommandSpec,
)
from trainguard.protocol.wire import DesiredState
from trainguard.service.engine import command_state
from trainguard.service.routes.runs import command_route
from tests.service.conftest import register


def _post(c: Any, command: str, body: dict[str, Any] | None = None) -> Any:
    return c.post(f"/v1/runs/run-1/{command}", json=body)


def _desired(c: Any) -> dict[str, Any]:
    return c.get("/v1/runs/run-1").json()["desired"]


def _only_changed(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in after.items() if before[k] != v and k != "reason"}


def test_grad_clip_sets_the_norm_every_rank_clips_to(app_factory) -> None:
    with app_factory() as c:
        register(c)
        before = _desired(c)
        r = _post(c, "grad-clip", {"max_norm": 2.5, "reason": "spiky gradients"})
        assert r.status_code == 200 and r.json()["command"] == "grad_clip" and r.json()["changed"] is True
        after = _desired(c)
        assert _only_changed(before, after) == {"generation": 1, "grad_clip_norm": 2.5}
        assert after["reason"] == "spiky gradients"
        assert _post(c, "grad-clip", {"max_norm": 2.5}).json()["changed"] is False  # the same value: no new generation
        assert _post(c, "grad-clip", {"max_norm": 0}).json()["desired"]["grad_clip_norm"] == 0.0  # 0 ends the clipping
        for bad, why in (({"max_norm": -1}, "body.max_norm: Input should be greater than or equal to 0"),
                         ({"max_norm": MAX_GRAD_CLIP * 2}, f"body.max_norm: Input should be less than or equal to {int(MAX_GRAD_CLIP)}"),
                         ({"max_norm": "NaN"}, "body.max_norm: Input should be a valid number"),
                         ({}, "body.max_norm: Field required")):
            r = _post(c, "grad-clip", bad)
            assert r.status_code == 422 and r.json()["detail"] == f"the request does not validate: {why}", (bad, r.text)
        assert _desired(c)["generation"] == 2


def test_reset_optimizer_bumps_its_sequence_for_every_layer_or_the_named_ones(app_factory) -> None:
    with app_factory() as c:
        register(c)
        r = _post(c, "reset-optimizer")  # no body: every layer
        assert r.status_code == 200, r.text
        assert (r.json()["desired"]["reset_optimizer_seq"], r.json()["desired"]["reset_optimizer_layers"]) == (1, "")
        assert "every layer" in r.json()["desired"]["reason"]
        r = _post(c, "reset-optimizer", {"layers": ["encoder.0", "head"]})
        assert (r.json()["desired"]["reset_optimizer_seq"], r.json()["desired"]["reset_optimizer_layers"]) == (2, "encoder.0,head")
        # a reset is an event: the same layers again reset them again
        assert _post(c, "reset-optimizer", {"layers": ["encoder.0", "head"]}).json()["desired"]["reset_optimizer_seq"] == 3
        r = _post(c, "reset-optimizer", {"layers": ["a,b"]})
        assert r.status_code == 422 and "without commas" in r.json()["detail"] and "'a,b'" in r.json()["detail"]
        assert _desired(c)["reset_optimizer_seq"] == 3


@pytest.mark.parametrize("command, field, top", [("momentum", "momentum_scale", MOMENTUM_SCALE_MAX),
                                                 ("weight-decay-scale", "weight_decay_scale", WEIGHT_DECAY_SCALE_MAX)])
def test_a_multiplier_takes_a_scale_or_a_factor_held_in_its_range(app_factory, command: str, field: str, top: float) -> None:
    with app_factory() as c:
        register(c)
        assert _post(c, command, {"factor": 1.5}).json()["desired"][field] == 1.5
        assert _post(c, command, {"factor": 2.0}).json()["desired"][field] == 3.0
        assert _post(c, command, {"factor": top}).json()["desired"][field] == top  # 3 x top stops at the top
        assert _post(c, command, {"scale": 0.5}).json()["desired"][field] == 0.5
        assert _desired(c)["generation"] == 4
        for bad, why in (({"scale": 0.5, "factor": 2.0}, "give exactly one of 'scale' (absolute) or 'factor'"),
                         ({}, "give exactly one of 'scale' (absolute) or 'factor'"),
                         ({"scale": top * 2}, f"body.scale: Input should be less than or equal to {top:g}"),
                         ({"factor": 0}, "body.factor: Input should be greater than 0")):
            r = _post(c, command, bad)
            assert r.status_code == 422 and why in r.json()["detail"], (bad, r.text)
        assert _desired(c)[field] == 0.5


def test_momentum_needs_a_positive_scale_and_weight_decay_may_be_turned_off(app_factory) -> None:
    with app_factory() as c:
        register(c)
        r = _post(c, "momentum", {"scale": 0})
        assert r.status_code == 422 and r.json()["detail"].endswith("body.scale: Input should be greater than 0")
        assert _post(c, "weight-decay-scale", {"scale": 0}).json()["desired"]["weight_decay_scale"] == 0.0
        # a factor of no weight decay is still none
        assert _post(c, "weight-decay-scale", {"factor": 2.0}).json()["changed"] is False


def test_refused_commands_answer_409_with_the_reason(app_factory) -> None:
    with app_factory() as c:
        register(c)
        r = _post(c, "accumulation", {"steps": 4})
        assert r.status_code == 409 and r.json()["detail"] == (
            "run 'run-1' does not let the controller set its accumulation steps "
            "(attach the agent with accumulation_steps=N to opt in)")
        r = _post(c, "rollback")
        assert r.status_code == 409 and r.json()["detail"].startswith("rollback refused: the run reports no snapshot")
        assert _desired(c)["generation"] == 0


def test_a_command_body_given_as_a_dict_is_validated_into_the_commands_request() -> None:
    d = DesiredState()
    assert command_state(d, "grad_clip", "why", params={"max_norm": 3.0}).grad_clip_norm == 3.0
    assert command_state(d, "pause", "why").paused is True  # None: the body's defaults
    with pytest.raises(ValueError, match=r"^grad_clip: max_norm: Input should be greater than or equal to 0$"):
        command_state(d, "grad_clip", "why", params={"max_norm": -1.0})
    with pytest.raises(ValueError, match="unknown command 'data_skip'"):  # internal: the recovery's own
        command_state(d, "data_skip", "why", params={"until": 10})


def test_the_openapi_document_lists_a_route_for_every_operator_command(app_factory) -> None:
    with app_factory() as c:
        paths = c.get("/openapi.json").json()["paths"]
    operator = [spec for spec in REGISTRY if spec.operator]
    assert {"grad_clip", "reset_optimizer", "momentum", "weight_decay_scale"} <= {s.name for s in operator}
    for spec in operator:
        op = paths[f"/v1/runs/{{run}}/{spec.url}"]["post"]
        assert op["summary"] == spec.summary and "commands" in op["tags"]
        assert op["security"] == [{"bearer": [spec.scope]}]
        assert op["operationId"].startswith(f"command_{spec.name}_")
        assert op["requestBody"]["content"]["application/json"]["schema"] in (
            {"$ref": f"#/components/schemas/{spec.request.__name__}"},
            {"anyOf": [{"$ref": f"#/components/schemas/{spec.request.__name__}"}, {"type": "null"}],
             "title": "Body"})
    assert "/v1/runs/{run}/data-skip" not in paths  # not an operator's command


class _KnobRequest(CommandRequest):
    level: int = Field(ge=1, le=9)


def test_a_new_command_gets_its_route_from_its_declaration() -> None:
    spec = CommandSpec("test_knob", "Set the test knob", lambda d, p, ctx: Change(), request=_KnobRequest, scope="rules")
    router = APIRouter(prefix="/v1")
    command_route(spec, router)
    app = FastAPI()
    app.include_router(router)
    op = app.openapi()["paths"]["/v1/runs/{run}/test-knob"]["post"]
    assert op["summary"] == "Set the test knob" and op["requestBody"]["required"] is True
    assert op["requestBody"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/_KnobRequest"}
    assert op["security"] == [{"bearer": ["rules"]}]
    assert "test_knob" not in BY_NAME


def test_a_finished_run_refuses_a_command_unless_it_is_queued_for_its_next_registration(app_factory) -> None:
    """A command to a finished run would change nothing until a job registers the name again, and
    then apply at once (weeks later, perhaps): refused (409) saying so, the desired state unchanged;
    with on_restart=true accepted, the answer saying when it applies, and the job that registers
    the name again starts with it. A live run's answer says it applies now."""
    with app_factory() as c:
        register(c, world_size=1)
        assert _post(c, "pause", {"reason": "live"}).json()["applies"] == "now"
        assert _post(c, "resume").status_code == 200
        assert c.post("/v1/runs/run-1/finish", json={"step": 70, "reason": "completed"}).status_code == 200
        before = _desired(c)
        r = _post(c, "pause", {"reason": "oops"})
        assert (r.status_code, r.json()["detail"]) == (409, (
            "run 'run-1' finished at step 70 (completed); its ranks are gone, so pause would apply only when a job "
            "registers the name 'run-1' again, however much later. To have a job restarted under this name start with "
            "it, send it with on_restart=true (the CLI's --on-restart)"))
        assert _desired(c) == before
        assert [e["kind"] for e in c.get("/v1/runs/run-1/events").json()].count("desired") == 2  # (pause, resume)
        r = c.post("/v1/runs/run-1/pause", json={"reason": "hold the restart"}, params={"on_restart": "true"})
        assert r.status_code == 200
        assert (r.json()["applies"], r.json()["desired"]["paused"], r.json()["desired"]["generation"]) == (
            "when_registered_again", True, before["generation"] + 1)
        assert register(c, world_size=1)["desired"]["paused"] is True  # the job restarted under the name
