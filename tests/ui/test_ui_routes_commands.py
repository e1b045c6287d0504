"""The console's actions (service/routes/ui.py) without a browser: ``GET /ui/api/commands`` lists
the registry's operator commands with their body's fields, each action is validated by its request
model (422 with the model's message), needs its scope, the CSRF token and the same origin, and
changes the desired state the API then shows; ``…/preview`` answers what an action would change
(or why it would be refused) and changes nothing."""

from __future__ import annotations

from typing import Callable

from fastapi.testclient import TestClient

from tests.ui.test_ui_routes import AGENT_AUTH, OPERATOR, READER, TOKENS, _login, _register, client_factory  # noqa: F401
from trainguard.protocol.commands import MAX_GRAD_CLIP, GradClipRequest, MAX_RESET_LAYERS, MOMENTUM_SCALE_MAX, REGISTRY
from trainguard.service.routes.ui import CSRF_HEADER

API = {"Authorization": f"Bearer {OPERATOR}"}


def _desired(client: TestClient, run: str = "run-1") -> dict:
    return client.get(f"/v1/runs/{run}", headers=API).json()["desired"]


def test_the_command_list_is_the_registrys_operator_commands_with_their_fields(client_factory: Callable[..., TestClient]) -> None:
    client = client_factory(**TOKENS)
    assert client.get("/ui/api/commands").status_code == 401  # a read of the console: a session first
    _login(client, READER)  # reading needs no more than the read scope
    resp = client.get("/ui/api/commands")
    assert resp.status_code == 200
    listed = resp.json()
    by_name = {c["name"]: c for c in listed}
    assert [c["name"] for c in listed] == [s.name for s in REGISTRY if s.operator and s.console]
    # what the console lacked before the registry, and the four new ones
    assert {"rollback", "verify", "memory_trace", "accumulation", "grad_clip", "reset_optimizer", "momentum",
            "weight_decay_scale"} <= set(by_name)
    assert "data_skip" not in by_name  # the ladder's own step, not an operator's
    assert {(c["name"], c["kind"]) for c in listed if c["kind"] == "diagnostic"} == {("memory_trace", "diagnostic"), ("verify", "diagnostic"),
                                                                                           ("verify_float32", "diagnostic")}
    assert {c["name"] for c in listed if c["dangerous"]} == {"stop", "rollback", "reset_optimizer"}
    assert by_name["pause"] | {"fields": None} == {"name": "pause", "url": "pause", "summary": "Pause the run in place (every rank, same step)",
                                                     "kind": "control", "scope": "command", "dangerous": False, "state": ["paused"],
                                                     "fields": None} and by_name["pause"]["fields"] == []
    (max_norm,) = by_name["grad_clip"]["fields"]
    described = GradClipRequest.model_fields["max_norm"].description or ""  # the model's words, shown as the field's hint
    assert max_norm == {"name": "max_norm", "type": "number", "required": True, "description": described, "default": None,
                        "minimum": 0, "maximum": MAX_GRAD_CLIP, "exclusive_minimum": None, "exclusive_maximum": None,
                        "choices": [], "max_items": None, "max_length": None}
    assert by_name["grad_clip"]["url"] == "grad-clip" and by_name["grad_clip"]["state"] == ["grad_clip_norm"]
    scale, factor = by_name["momentum"]["fields"]
    assert (scale["name"], scale["required"], scale["exclusive_minimum"], scale["maximum"]) == ("scale", False, 0.0, MOMENTUM_SCALE_MAX)
    assert (factor["name"], factor["exclusive_minimum"]) == ("factor", 0)
    steps, rule = by_name["accumulation"]["fields"]
    assert (steps["type"], steps["required"], steps["minimum"]) == ("integer", True, 1)
    assert (rule["type"], rule["choices"], rule["default"]) == ("choice", ["none", "sqrt", "linear"], "sqrt")
    (layers,) = by_name["reset_optimizer"]["fields"]
    assert (layers["type"], layers["default"], layers["max_items"], layers["required"]) == ("list", [], MAX_RESET_LAYERS, False)
    assert by_name["reset_optimizer"]["state"] == ["reset_optimizer_seq", "reset_optimizer_layers"]


def test_the_new_commands_from_the_console_change_the_desired_state(client_factory: Callable[..., TestClient]) -> None:
    client = client_factory(**TOKENS)
    _register(client, headers=AGENT_AUTH)
    csrf = {CSRF_HEADER: _login(client, OPERATOR)["csrf"]}
    for command, body, want in [
        ("grad-clip", {"max_norm": 1.5}, {"grad_clip_norm": 1.5}),
        ("momentum", {"scale": 0.8}, {"momentum_scale": 0.8}),
        ("momentum", {"factor": 0.5}, {"momentum_scale": 0.4}),
        ("weight-decay-scale", {"scale": 3}, {"weight_decay_scale": 3.0}),
        ("reset-optimizer", {"layers": ["blocks.0.", "head"]}, {"reset_optimizer_seq": 1, "reset_optimizer_layers": "blocks.0.,head"}),
        ("verify", {}, {"verify_seq": 1}),
        ("memory-trace", {}, {"memory_trace_seq": 1}),
    ]:
        resp = client.post(f"/ui/api/runs/run-1/{command}", json=body | {"reason": "console test"}, headers=csrf)
        assert resp.status_code == 200, (command, resp.text)
        assert resp.json()["changed"] is True
        desired = _desired(client)
        assert {k: desired[k] for k in want} == want, command
    events = client.get("/v1/runs/run-1/events", headers=API).json()
    actor = client.get("/ui/api/session").json()["actor"]
    assert [(e["actor"], e["data"]["command"]) for e in events if e["kind"] == "desired"] == [
        (actor, c) for c in ("grad_clip", "momentum", "momentum", "weight_decay_scale", "reset_optimizer", "verify", "memory_trace")]
    assert _desired(client)["generation"] == 7


def test_a_bad_body_is_422_with_the_models_message_and_changes_nothing(client_factory: Callable[..., TestClient]) -> None:
    client = client_factory(**TOKENS)
    _register(client, headers=AGENT_AUTH)
    csrf = {CSRF_HEADER: _login(client, OPERATOR)["csrf"]}
    for command, body, message in [
        ("grad-clip", {}, "max_norm: Field required"),
        ("grad-clip", {"max_norm": -1}, "max_norm: Input should be greater than or equal to 0"),
        ("grad-clip", {"max_norm": "x"}, "max_norm: Input should be a valid number"),
        ("momentum", {"scale": 0.5, "factor": 2}, "give exactly one of 'scale' (absolute) or 'factor' (times the current one)"),
        ("reset-optimizer", {"layers": [""]}, "a layer name prefix is 1-256 characters without commas or control characters, got ''"),
        ("accumulation", {"steps": 0}, "steps: Input should be greater than or equal to 1"),
    ]:
        for suffix in ("", "/preview"):
            resp = client.post(f"/ui/api/runs/run-1/{command}{suffix}", json=body, headers=csrf)
            assert (resp.status_code, resp.json()["detail"]) == (422, message), (command, suffix)
    assert _desired(client)["generation"] == 0


def test_actions_need_their_scope_csrf_and_origin(client_factory: Callable[..., TestClient]) -> None:
    client = client_factory(**TOKENS)
    _register(client, headers=AGENT_AUTH)
    csrf = _login(client, READER)["csrf"]
    for command, body in (("grad-clip", {"max_norm": 1.0}), ("rollback", {}), ("verify", {})):
        for suffix in ("", "/preview"):
            resp = client.post(f"/ui/api/runs/run-1/{command}{suffix}", json=body, headers={CSRF_HEADER: csrf})
            assert (resp.status_code, resp.json()["detail"]) == (403, "this operator token lacks the 'command' scope"), command
    csrf = _login(client, OPERATOR)["csrf"]
    assert client.post("/ui/api/runs/run-1/grad-clip", json={"max_norm": 1.0}).status_code == 403  # no CSRF token
    assert client.post("/ui/api/runs/run-1/grad-clip", json={"max_norm": 1.0},
                       headers={CSRF_HEADER: csrf, "Origin": "http://evil.example.org"}).status_code == 403
    resp = client.post("/ui/api/runs/run-1/data-skip", json={"until": 5}, headers={CSRF_HEADER: csrf})
    assert resp.status_code == 404 and resp.json()["detail"].startswith("unknown action 'data-skip'; known: pause, resume,")
    assert _desired(client)["generation"] == 0


def test_a_preview_answers_the_change_or_the_refusal_and_changes_nothing(client_factory: Callable[..., TestClient]) -> None:
    client = client_factory(**TOKENS)
    _register(client, headers=AGENT_AUTH)
    csrf = {CSRF_HEADER: _login(client, OPERATOR)["csrf"]}
    resp = client.post("/ui/api/runs/run-1/momentum/preview", json={"factor": 0.5}, headers=csrf)
    assert resp.status_code == 200
    assert resp.json() == {"command": "momentum", "note": "", "applies": "now", "changes": [
        {"field": "momentum_scale", "now": 1.0, "after": 0.5}, {"field": "generation", "now": 0, "after": 1}]}
    resp = client.post("/ui/api/runs/run-1/reset-optimizer/preview", json={}, headers=csrf)
    assert resp.json()["changes"] == [{"field": "reset_optimizer_seq", "now": 0, "after": 1}, {"field": "generation", "now": 0, "after": 1}]
    assert resp.json()["note"] == "optimizer state reset for every layer"
    assert client.post("/ui/api/runs/run-1/resume/preview", json={}, headers=csrf).json()["changes"] == []  # running already
    resp = client.post("/ui/api/runs/run-1/rollback/preview", json={}, headers=csrf)  # no snapshot reported
    assert resp.status_code == 409 and resp.json()["detail"].startswith("rollback refused: the run reports no snapshot")
    # what the preview says is what the command then answers
    for command, body in (("rollback", {}), ("accumulation", {"steps": 4})):
        preview = client.post(f"/ui/api/runs/run-1/{command}/preview", json=body, headers=csrf)
        sent = client.post(f"/ui/api/runs/run-1/{command}", json=body, headers=csrf)
        assert preview.status_code == sent.status_code == 409 and preview.json() == sent.json(), command
    assert "accumulation_steps=N" in preview.json()["detail"]
    assert _desired(client)["generation"] == 0
    assert client.post("/ui/api/runs/nope/pause/preview", json={}, headers=csrf).status_code == 404


def test_a_finished_run_refuses_an_action_from_the_console_unless_it_is_queued_for_its_restart(
        client_factory: Callable[..., TestClient]) -> None:
    """The console's preview and action answer a finished run as the API does (409 with its words);
    with on_restart beside the body's fields they say when it applies, and the action is queued."""
    client = client_factory(**TOKENS)
    _register(client, headers=AGENT_AUTH)
    assert client.post("/v1/runs/run-1/finish", json={"step": 9}, headers=AGENT_AUTH).status_code == 200
    csrf = {CSRF_HEADER: _login(client, OPERATOR)["csrf"]}
    preview = client.post("/ui/api/runs/run-1/pause/preview", json={}, headers=csrf)
    sent = client.post("/ui/api/runs/run-1/pause", json={}, headers=csrf)
    api = client.post("/v1/runs/run-1/pause", headers=API)
    assert preview.status_code == sent.status_code == api.status_code == 409
    assert preview.json() == sent.json() == api.json() and preview.json()["detail"].startswith(
        "run 'run-1' finished at step 9 (completed); its ranks are gone, so pause would apply only when a job registers")
    assert client.post("/ui/api/runs/run-1/pause", json={"on_restart": "yes"}, headers=csrf).status_code == 422
    assert _desired(client)["generation"] == 0
    preview = client.post("/ui/api/runs/run-1/pause/preview", json={"on_restart": True}, headers=csrf)
    assert (preview.json()["applies"], preview.json()["changes"][0]) == (
        "when_registered_again", {"field": "paused", "now": False, "after": True})
    sent = client.post("/ui/api/runs/run-1/pause", json={"on_restart": True, "reason": "hold it"}, headers=csrf)
    assert (sent.status_code, sent.json()["applies"], sent.json()["desired"]["paused"]) == (200, "when_registered_again", True)
    assert _desired(client)["generation"] == 1


def _registered(client: TestClient, run: str = "run-1") -> bool:
    status = client.get(f"/v1/runs/{run}", headers=API).status_code
    assert status in (200, 404)
    return status == 200


def test_a_run_is_deleted_from_the_console_only_with_the_command_scope_csrf_and_origin(
    client_factory: Callable[..., TestClient],
) -> None:
    client = client_factory(**TOKENS)
    _register(client, headers=AGENT_AUTH)
    assert client.post("/v1/runs/run-1/finish", json={"step": 7}, headers=AGENT_AUTH).status_code == 200
    csrf = _login(client, READER)["csrf"]
    resp = client.request("DELETE", "/ui/api/runs/run-1", json={}, headers={CSRF_HEADER: csrf})
    assert (resp.status_code, resp.json()["detail"]) == (403, "this operator token lacks the 'command' scope")
    csrf = _login(client, OPERATOR)["csrf"]
    assert client.request("DELETE", "/ui/api/runs/run-1", json={}).status_code == 403  # no CSRF token
    assert client.request("DELETE", "/ui/api/runs/run-1", json={},
                          headers={CSRF_HEADER: csrf, "Origin": "http://evil.example.org"}).status_code == 403
    assert _registered(client)

    resp = client.request("DELETE", "/ui/api/runs/run-1", json={"reason": "done with it"}, headers={CSRF_HEADER: csrf})
    assert (resp.status_code, resp.json()) == (200, {"run": "run-1", "job": "job-a", "status": "finished", "deleted": True})
    assert not _registered(client)
    assert "run-1" not in [r["run"] for r in client.get("/ui/api/runs").json()]
    # the deleted run's audit trail, read as the page reads it after a deletion
    events = client.get("/ui/api/events", params={"run": "run-1"}).json()["events"]
    actor = client.get("/ui/api/session").json()["actor"]
    assert [e["kind"] for e in events] == ["deleted", "finished", "registered"]
    assert (events[0]["actor"], events[0]["reason"], events[0]["data"]) == (actor, "done with it", {"status": "finished", "forced": False})
    resp = client.request("DELETE", "/ui/api/runs/run-1", json={}, headers={CSRF_HEADER: csrf})
    assert (resp.status_code, resp.json()["detail"]) == (404, "run 'run-1' is not registered")


def test_a_live_run_is_refused_with_the_controllers_reason_until_forced(client_factory: Callable[..., TestClient]) -> None:
    client = client_factory(**TOKENS)
    _register(client, headers=AGENT_AUTH)
    csrf = {CSRF_HEADER: _login(client, OPERATOR)["csrf"]}
    assert client.post("/ui/api/runs/run-1/pause", json={}, headers=csrf).status_code == 200
    refused = client.request("DELETE", "/ui/api/runs/run-1", json={"reason": "not yet"}, headers=csrf)
    assert (refused.status_code, refused.json()["detail"]) == (409, (
        "run 'run-1' is live: it is paused, and its processes may be waiting for a resume; stop it first, or delete it "
        "anyway with force=true (an agent still running registers it again, as a new run)"))
    assert client.delete("/v1/runs/run-1", headers=API).json() == refused.json()  # the API's own words
    assert _registered(client)
    resp = client.request("DELETE", "/ui/api/runs/run-1", json={"force": True, "reason": "abandoned"}, headers=csrf)
    assert (resp.status_code, resp.json()["status"]) == (200, "paused")
    deleted = client.get("/v1/runs/run-1/events", headers=API).json()[-1]
    assert (deleted["kind"], deleted["reason"], deleted["data"]) == ("deleted", "abandoned", {"status": "paused", "forced": True})
    assert not _registered(client)


def test_a_bad_deletion_body_is_422_and_deletes_nothing(client_factory: Callable[..., TestClient]) -> None:
    client = client_factory(**TOKENS)
    _register(client, headers=AGENT_AUTH)
    csrf = {CSRF_HEADER: _login(client, OPERATOR)["csrf"]}
    for body, message in [
        ({"force": "yes"}, "force: Input should be a valid boolean"),
        ({"reason": "x" * 2001}, "reason: String should have at most 2000 characters"),
        ({"reason": "a\x00b"}, "reason: must be text without control characters (tab and newline aside); it contains U+0000"),
        ({"forced": True}, "forced: Extra inputs are not permitted"),
    ]:
        resp = client.request("DELETE", "/ui/api/runs/run-1", json=body, headers=csrf)
        assert resp.status_code == 422 and resp.json()["detail"].startswith(message), (body, resp.json())
    assert _registered(client)
