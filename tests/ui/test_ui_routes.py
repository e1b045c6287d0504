"""The console's endpoints without a browser: sign-in and its cookie, CSRF and Origin checks,
scopes, sign-out, the anonymous session without tokens, the window and incidents it serves, the
local /docs."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from fastapi.testclient import TestClient

from trainguard.service.app import create_app
from trainguard.service.config import Settings
from trainguard.service.routes.ui import COOKIE, CSRF_HEADER, ConsoleSessions
from trainguard.service.auth import ANONYMOUS
from tests.service.conftest import LADDER_STEPS, climb_ladder

OPERATOR, READER, AGENT = "operator-token-123", "reader-token-123", "agent-token-123"
HOOKS = "hooks-token-123"
TOKENS = {"operator_tokens": (OPERATOR, f"{READER}:read", f"{HOOKS}:webhooks"), "agent_tokens": (AGENT,)}
AGENT_AUTH = {"Authorization": f"Bearer {AGENT}"}


@pytest.fixture
def client_factory(tmp_path: Path) -> Iterator[Callable[..., TestClient]]:
    clients: list[TestClient] = []

    def make(**overrides: Any) -> TestClient:
        client = TestClient(create_app(Settings(db=tmp_path / f"tg{len(clients)}.db", **overrides)), base_url="http://127.0.0.1:8000")
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for c in clients:
        c.__exit__(None, None, None)


def _register(client: TestClient, run: str = "run-1", headers: dict[str, str] | None = None, world: int = 2) -> None:
    body = {"job": "job-a", "run": run, "world_size": world, "agent_version": "test",
            "ranks": [{"rank": r, "local_rank": r, "host": "127.0.0.1", "port": 9100 + r} for r in range(world)]}
    assert client.post("/v1/runs", json=body, headers=headers or {}).status_code == 200


def _login(client: TestClient, token: str) -> dict[str, Any]:
    resp = client.post("/ui/login", json={"token": token})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_login_sets_an_httponly_samesite_strict_cookie_that_is_not_the_token(client_factory: Callable[..., TestClient]) -> None:
    client = client_factory(**TOKENS)
    resp = client.post("/ui/login", json={"token": OPERATOR})
    assert resp.status_code == 200
    cookie = resp.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE}=")
    attrs = {a.strip().split("=")[0].lower() for a in cookie.split(";")[1:]}
    assert {"httponly", "samesite", "path", "max-age"} <= attrs
    assert re.search(r"(?i)samesite=strict", cookie) and re.search(r"(?i)path=/ui(;|$)", cookie)
    assert OPERATOR not in cookie and OPERATOR not in resp.text
    body = resp.json()
    assert body["signed_in"] and body["auth_required"] and body["kind"] == "operator"
    assert body["scopes"] == ["command", "read", "rules", "webhooks"] and len(body["csrf"]) >= 32
    # the session answers the same CSRF token; without the cookie there is no session
    assert client.get("/ui/api/session").json()["csrf"] == body["csrf"]
    anonymous = TestClient(client.app, base_url="http://127.0.0.1:8000")
    assert anonymous.get("/ui/api/session").json() == {"signed_in": False, "auth_required": True}
    assert anonymous.get("/ui/api/runs").status_code == 401


def test_a_cookie_over_https_is_secure(client_factory: Callable[..., TestClient]) -> None:
    client = client_factory(**TOKENS)
    secure = TestClient(client.app, base_url="https://127.0.0.1:8443")
    cookie = secure.post("/ui/login", json={"token": OPERATOR}).headers["set-cookie"]
    assert re.search(r"(?i);\s*secure(;|$)", cookie)
    assert not re.search(r"(?i);\s*secure(;|$)", client.post("/ui/login", json={"token": OPERATOR}).headers["set-cookie"])


@pytest.mark.parametrize("token, content_type, status", [
    ("not-a-known-token", "application/json", 401),
    (AGENT, "application/json", 403),
    (OPERATOR, "text/plain", 415),
    (OPERATOR, "application/x-www-form-urlencoded", 415),
])
def test_login_refuses_unknown_and_agent_tokens_and_non_json_bodies(
    client_factory: Callable[..., TestClient], token: str, content_type: str, status: int,
) -> None:
    client = client_factory(**TOKENS)
    resp = client.post("/ui/login", content=f'{{"token": "{token}"}}', headers={"Content-Type": content_type})
    assert resp.status_code == status, resp.text
    assert "set-cookie" not in resp.headers and token not in resp.text


def test_actions_need_the_csrf_token_and_the_same_origin(client_factory: Callable[..., TestClient]) -> None:
    client = client_factory(**TOKENS)
    _register(client, headers=AGENT_AUTH)
    csrf = _login(client, OPERATOR)["csrf"]
    for headers in ({}, {CSRF_HEADER: "wrong"}, {CSRF_HEADER: csrf, "Origin": "http://evil.example"}):
        resp = client.post("/ui/api/runs/run-1/pause", json={}, headers=headers)
        assert resp.status_code == 403, (headers, resp.text)
    assert client.get("/ui/api/runs/run-1").json()["run"]["desired"]["generation"] == 0  # nothing changed
    resp = client.post("/ui/api/runs/run-1/pause", json={"reason": "looking at it"},
                       headers={CSRF_HEADER: csrf, "Origin": "http://127.0.0.1:8000"})
    assert resp.status_code == 200, resp.text
    want = {"generation": 1, "paused": True, "lr_scale": 1.0, "checkpoint_seq": 0, "stop": False, "reason": "looking at it"}
    assert resp.json()["changed"] and {k: resp.json()["desired"][k] for k in want} == want
    # the API sees the same state, and the audit log names the operator's token
    run = client.get("/v1/runs/run-1", headers={"Authorization": f"Bearer {OPERATOR}"}).json()
    assert run["desired"]["paused"] and run["desired_generation"] == 1
    events = client.get("/v1/runs/run-1/events", headers={"Authorization": f"Bearer {OPERATOR}"}).json()
    assert events[-1]["kind"] == "desired" and events[-1]["actor"] == _login(client, OPERATOR)["actor"]


def test_behind_a_proxy_the_external_url_is_a_same_origin(client_factory: Callable[..., TestClient]) -> None:
    plain = client_factory(**TOKENS, external_url="https://tg.example.org")
    _register(plain, headers=AGENT_AUTH)
    # the cookie is Secure (the public address is https): an http client would not send it back
    assert re.search(r"(?i);\s*secure(;|$)", plain.post("/ui/login", json={"token": OPERATOR}).headers["set-cookie"])
    client = TestClient(plain.app, base_url="https://127.0.0.1:8443")  # what the TLS proxy forwards
    csrf = _login(client, OPERATOR)["csrf"]
    for origin, status in (("https://tg.example.org", 200), ("https://evil.example.org", 403), ("null", 403)):
        resp = client.post("/ui/api/runs/run-1/checkpoint", json={}, headers={CSRF_HEADER: csrf, "Origin": origin})
        assert resp.status_code == status, (origin, resp.text)


def test_lr_scale_is_validated_and_applied(client_factory: Callable[..., TestClient]) -> None:
    client = client_factory(**TOKENS)
    _register(client, headers=AGENT_AUTH)
    csrf = {CSRF_HEADER: _login(client, OPERATOR)["csrf"]}
    for bad in ({}, {"scale": 0}, {"scale": -1}, {"scale": "x"}, {"scale": 1e7}):
        assert client.post("/ui/api/runs/run-1/lr-scale", json=bad, headers=csrf).status_code == 422, bad
    assert client.post("/ui/api/runs/run-1/explode", json={}, headers=csrf).status_code == 404
    assert client.post("/ui/api/runs/no-such-run/pause", json={}, headers=csrf).status_code == 404
    resp = client.post("/ui/api/runs/run-1/lr-scale", json={"scale": 0.25}, headers=csrf)
    assert resp.status_code == 200 and resp.json()["desired"]["lr_scale"] == 0.25


def test_a_read_only_token_reads_but_every_action_is_refused(client_factory: Callable[..., TestClient]) -> None:
    client = client_factory(**TOKENS)
    _register(client, headers=AGENT_AUTH)
    body = _login(client, READER)
    assert body["scopes"] == ["read"]
    assert client.get("/ui/api/runs").json()[0]["run"] == "run-1"
    for command, payload in (("pause", {}), ("resume", {}), ("checkpoint", {}), ("stop", {}), ("lr-scale", {"scale": 0.5})):
        resp = client.post(f"/ui/api/runs/run-1/{command}", json=payload, headers={CSRF_HEADER: body["csrf"]})
        assert resp.status_code == 403, command
    assert client.get("/ui/api/runs/run-1").json()["run"]["desired_generation"] == 0


def test_logout_ends_the_session_and_needs_csrf(client_factory: Callable[..., TestClient]) -> None:
    client = client_factory(**TOKENS)
    csrf = _login(client, OPERATOR)["csrf"]
    assert client.post("/ui/logout").status_code == 403
    resp = client.post("/ui/logout", headers={CSRF_HEADER: csrf})
    assert resp.status_code == 200
    assert re.search(rf'{COOKIE}="?"?;', resp.headers["set-cookie"]) and "max-age=0" in resp.headers["set-cookie"].lower()
    assert client.get("/ui/api/runs").status_code == 401
    assert client.get("/ui/api/session").json()["signed_in"] is False


def test_a_token_without_read_signs_in_and_out_but_reads_nothing(client_factory: Callable[..., TestClient]) -> None:
    client = client_factory(**TOKENS)
    body = _login(client, HOOKS)
    assert body["scopes"] == ["webhooks"]
    assert client.get("/ui/api/runs").status_code == 403 and client.get("/ui/api/events").status_code == 403
    assert client.post("/ui/logout", headers={CSRF_HEADER: body["csrf"]}).status_code == 200
    assert client.get("/ui/api/runs").status_code == 401


def test_without_tokens_the_console_needs_no_sign_in(client_factory: Callable[..., TestClient]) -> None:
    client = client_factory()
    _register(client)
    body = client.get("/ui/api/session").json()
    assert body["signed_in"] and not body["auth_required"] and body["kind"] == "anonymous"
    assert client.post("/ui/api/runs/run-1/pause", json={}).status_code == 403  # CSRF still guards actions
    assert client.post("/ui/api/runs/run-1/pause", json={}, headers={CSRF_HEADER: body["csrf"]}).json()["desired"]["paused"]


def test_the_run_endpoint_serves_the_window_nan_included(client_factory: Callable[..., TestClient]) -> None:
    client = client_factory(**TOKENS, window_reports=8, rank_window_reports=3)
    _register(client, headers=AGENT_AUTH)
    sent = []
    for i in range(12):
        step = 5 * (i + 1)
        loss = math.nan if i == 10 else 4.0 / (i + 1)
        values = {"trainguard_loss": loss, "trainguard_grad_norm": float(i)}
        ranks = {"step_time_s": [0.1 + i, 0.2 + i], "grad_norm": [float(i), float(i) + 0.5]}
        resp = client.post("/v1/runs/run-1/reports", headers=AGENT_AUTH, content=_report_json(step, values, ranks))
        assert resp.status_code == 200, resp.text
        sent.append((i + 1, step, values, ranks))
    _login(client, READER)
    body = client.get("/ui/api/runs/run-1").json()
    rows = body["window"]["rows"]
    assert [(r["seq"], r["step"]) for r in rows] == [(s, st) for s, st, _, _ in sent[-8:]]
    for r, (_, _, values, _) in zip(rows, sent[-8:]):
        want = {k: ("NaN" if math.isnan(v) else v) for k, v in values.items()}
        assert {k: r["values"][k] for k in want} == want
    assert [(r["seq"], r["vectors"]) for r in body["window"]["ranks"]] == [(s, rk) for s, _, _, rk in sent[-3:]]
    assert body["run"]["window_capacity"] == 8 and body["run"]["rank_window_capacity"] == 3
    # the NaN loss fired the default rule: its alert and diagnosis are served, newest first
    alerts = body["alerts"]
    assert alerts and alerts[0]["state"] in ("firing", "resolved") and alerts[0]["diagnosis"]["symptom"]
    assert [e["kind"] for e in body["events"]][:1] == ["registered"]


def test_the_run_endpoints_serve_its_incidents_as_the_api_lists_them(client_factory: Callable[..., TestClient]) -> None:
    client = client_factory(**TOKENS)
    _register(client, headers=AGENT_AUTH)
    climb_ladder(client, until=LADDER_STEPS["rollback"], headers=AGENT_AUTH)  # open: adaptive LR, then a rollback
    assert client.get("/ui/api/runs/run-1/incidents").status_code == 401  # the console's own session, not a token
    _login(client, READER)
    api = client.get("/v1/runs/run-1/incidents", headers={"Authorization": f"Bearer {READER}"}).json()
    (incident,) = api["incidents"]
    assert incident["outcome"] == "open" and [r["rung"] for r in incident["rungs"]] == ["adaptive_lr", "rollback"]
    assert client.get("/ui/api/runs/run-1").json()["incidents"] == [incident]
    assert client.get("/ui/api/runs/run-1/incidents").json() == {k: api[k] for k in ("incidents", "snapshots")}
    climb_ladder(client, after=LADDER_STEPS["rollback"], headers=AGENT_AUTH)
    (escalated,) = client.get("/ui/api/runs/run-1/incidents").json()["incidents"]
    assert escalated["outcome"] == "escalated" and escalated["rungs"][-1]["rung"] == "pause"
    assert client.get("/ui/api/runs/nope/incidents").status_code == 404


def _report_json(step: int, values: dict[str, float], ranks: dict[str, list[float]]) -> str:
    import json

    def enc(v: float) -> Any:
        return "NaN" if math.isnan(v) else v

    return json.dumps({"job": "job-a", "step_first": step, "step_last": step, "time": 1.0,
                       "values": {k: enc(v) for k, v in values.items()}, "ranks": ranks})


def test_audit_log_pages_newest_first(client_factory: Callable[..., TestClient]) -> None:
    client = client_factory(**TOKENS)
    _register(client, run="run-0", headers=AGENT_AUTH)
    csrf = {CSRF_HEADER: _login(client, OPERATOR)["csrf"]}
    for i in range(6):
        client.post("/ui/api/runs/run-0/" + ("pause" if i % 2 == 0 else "resume"), json={}, headers=csrf)
    every = client.get("/v1/runs/run-0/events", headers={"Authorization": f"Bearer {OPERATOR}"}).json()
    ids = [e["id"] for e in every][::-1]  # newest first
    first = client.get("/ui/api/events?limit=4").json()
    assert [e["id"] for e in first["events"]] == ids[:4]
    second = client.get(f"/ui/api/events?limit=4&before={first['before']}").json()
    assert [e["id"] for e in second["events"]] == ids[4:8] and second["before"] is None


def test_pages_are_served_with_a_self_only_content_security_policy(client_factory: Callable[..., TestClient]) -> None:
    client = client_factory(**TOKENS)
    assert client.get("/", follow_redirects=False).headers["location"] == "/ui"
    for path in ("/ui", "/ui/runs/any-run", "/ui/audit"):
        resp = client.get(path)
        assert resp.status_code == 200 and "<main id=\"app\">" in resp.text
        assert "default-src 'self'" in resp.headers["content-security-policy"]
        assert resp.headers["x-frame-options"] == "DENY"
    for asset in re.findall(r'(?:src|href)="(/ui/static/[^"]+)"', client.get("/ui").text):
        assert client.get(asset).status_code == 200, asset


def test_docs_page_loads_its_assets_from_the_controller(client_factory: Callable[..., TestClient]) -> None:
    client = client_factory(**TOKENS)
    html = client.get("/docs").text
    urls = re.findall(r'(?:src|href)="([^"]+)"', html) + re.findall(r"url: '([^']+)'", html)
    assert urls and all(u.startswith("/") and not u.startswith("//") for u in urls), urls
    for u in urls:
        assert client.get(u).status_code == 200, u
    assert "swagger-ui-bundle.js" in html and client.get("/redoc").status_code == 404


def test_sessions_expire_and_are_bounded() -> None:
    now = [0.0]
    sessions = ConsoleSessions(ttl_s=10.0, capacity=2, clock=lambda: now[0])
    a, _ = sessions.open(ANONYMOUS)
    b, _ = sessions.open(ANONYMOUS)
    c, _ = sessions.open(ANONYMOUS)  # over capacity: the oldest goes
    assert sessions.get(a) is None and sessions.get(b) is not None and len(sessions) == 2
    now[0] = 10.0
    assert sessions.get(b) is None and sessions.get(c) is None and sessions.get(None) is None
    with pytest.raises(ValueError):
        ConsoleSessions(ttl_s=0)


def _parse_sse(chunk: bytes) -> tuple[str, Any]:
    import json

    fields = dict(line.split(": ", 1) for line in chunk.decode().strip().split("\n") if ": " in line)
    return fields["event"], json.loads(fields["data"])


def test_the_run_stream_replays_events_after_its_cursor_then_sends_new_reports_and_the_status(
    client_factory: Callable[..., TestClient],
) -> None:
    from trainguard.service.routes.ui_streams import _updates

    client = client_factory(**TOKENS)
    _register(client, headers=AGENT_AUTH)
    for step in (10, 20, 30):
        client.post("/v1/runs/run-1/reports", headers=AGENT_AUTH, content=_report_json(step, {"trainguard_loss": 1.0 / step}, {}))
    csrf = {CSRF_HEADER: _login(client, OPERATOR)["csrf"]}
    client.post("/ui/api/runs/run-1/pause", json={}, headers=csrf)
    client.post("/ui/api/runs/run-1/lr-scale", json={"scale": 0.5}, headers=csrf)
    events = client.get("/v1/runs/run-1/events", headers={"Authorization": f"Bearer {OPERATOR}"}).json()
    assert [e["kind"] for e in events] == ["registered", "desired", "desired"]
    ctl = client.app.state.controller

    async def first(n: int, seq: int, after: int) -> list[tuple[str, Any]]:
        import asyncio

        out = []
        gen = _updates(ctl, "run-1", seq, after)

        async def read() -> None:
            async for chunk in gen:  # a write may hold several events
                for event in chunk.split(b"\n\n"):
                    if b"event: " in event:
                        out.append(_parse_sse(event))
                        if len(out) == n:
                            return

        try:
            await asyncio.wait_for(read(), 30)
        finally:
            await gen.aclose()
        return out

    got = client.portal.call(first, 3, 1, events[1]["id"])  # the page has report 1 and events up to the pause
    assert [kind for kind, _ in got] == ["audit", "report", "run"]
    assert got[0][1]["id"] == events[2]["id"] and got[0][1]["data"]["desired"]["lr_scale"] == 0.5
    assert [(r["seq"], r["step"], r["values"]["trainguard_loss"]) for r in got[1][1]["rows"]] == [(2, 20, 1 / 20), (3, 30, 1 / 30)]
    assert got[2][1]["desired"]["paused"] and got[2][1]["desired"]["lr_scale"] == 0.5 and got[2][1]["reports"] == 3


def test_the_run_stream_ends_with_gone_when_its_run_is_deleted(client_factory: Callable[..., TestClient]) -> None:
    import asyncio

    from trainguard.service.routes.ui_streams import _updates

    client = client_factory(**TOKENS)
    _register(client, headers=AGENT_AUTH)
    ctl = client.app.state.controller

    async def read_across_the_deletion() -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        gen = _updates(ctl, "run-1", 0, 0)

        async def read() -> None:
            async for chunk in gen:
                for event in chunk.split(b"\n\n"):
                    if b"event: " in event:
                        out.append(_parse_sse(event))
                        if out[-1][0] == "run" and "run-1" in ctl.runs:  # the page is open: another operator deletes the run
                            await ctl.delete_run("run-1", actor="someone else", force=True, reason="cleaning up")

        try:
            await asyncio.wait_for(read(), 30)  # the stream ends by itself
        finally:
            await gen.aclose()
        return out

    got = client.portal.call(read_across_the_deletion)
    assert got[0][0] == "run" and got[-1] == ("gone", {"run": "run-1"})
    assert {kind for kind, _ in got[1:-1]} <= {"audit"}
