"""Console sessions: bound to the token they signed in with (revoked or expired: the next read,
command or stream tick answers 401 or ends), bounded per token without ending another token's
sessions, failed sign-ins rate limited per address and in all (429 with Retry-After), live-update
streams capped per session and in all and built once for every stream, and an Origin that must
match in scheme, host and port."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from fastapi.testclient import TestClient

from trainguard.service import runstate
from trainguard.service.app import create_app
from trainguard.service.config import Settings
from trainguard.service.routes import ui_streams
from trainguard.service.routes.ui import COOKIE, CSRF_HEADER, ConsoleSessions, LoginLimiter

ADMIN, READER, HOOKS, AGENT = "admin-token-0001", "reader-token-001", "hooks-token-0001", "agent-token-0001"
TOKENS = {"operator_tokens": (ADMIN, f"{READER}:read", f"{HOOKS}:webhooks"), "agent_tokens": (AGENT,)}
BASE = "http://127.0.0.1:8000"


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Callable[..., TestClient]]:
    """``make(clock=..., client=(address, port))``: a started app; later calls with ``app=`` give
    another client (own cookies, own address) of the same app."""
    clients: list[TestClient] = []

    def factory(*, app: Any = None, clock: Callable[[], float] | None = None, client: tuple[str, int] = ("10.0.0.1", 5000)) -> TestClient:
        if app is None:
            app = create_app(Settings(db=tmp_path / f"tg{len(clients)}.db", **TOKENS), clock=clock)
        c = TestClient(app, base_url=BASE, client=client)
        c.__enter__()
        clients.append(c)
        return c

    yield factory
    for c in reversed(clients):
        c.__exit__(None, None, None)


def _h(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _login(c: TestClient, token: str) -> str:
    r = c.post("/ui/login", json={"token": token})
    assert r.status_code == 200, r.text
    return r.json()["csrf"]


def _register(c: TestClient, run: str = "run-1", world: int = 2) -> None:
    body = {"job": "job-a", "run": run, "world_size": world, "ranks": [
        {"rank": r, "local_rank": r, "host": "127.0.0.1", "port": 9100 + r} for r in range(world)]}
    assert c.post("/v1/runs", json=body, headers=_h(AGENT if run == "run-1" else ADMIN)).status_code == 200


def _read_stream(c: TestClient, path: str, until: Callable[[list[tuple[str, Any]]], bool] = lambda events: False,
                 during: Callable[[], None] = lambda: None) -> tuple[list[tuple[str, Any]], bool]:
    """Read ``path``'s events until ``until(events)`` (then close) or until the server ends it;
    ``during()`` runs once the first event arrived. Answers the events and whether the server
    ended the stream. A guard of 60 s turns a stream that never ends into a failure, not a hang."""
    events: list[tuple[str, Any]] = []
    ended = [False]

    def read() -> None:
        with c.stream("GET", path) as r:
            assert r.status_code == 200, r.read()
            ran = False
            for block in r.iter_raw():
                for chunk in block.split(b"\n\n"):
                    fields = dict(line.split(": ", 1) for line in chunk.decode().split("\n") if ": " in line)
                    if "event" in fields:
                        events.append((fields["event"], json.loads(fields["data"])))
                if events and not ran:
                    ran = True
                    during()
                if until(events):
                    return
            ended[0] = True

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(60)
    assert not reader.is_alive(), f"the stream {path} did not end ({events[-3:]})"
    return events, ended[0]


# -- bound to the token ----------------------------------------------------------------------------
def test_revoking_the_token_ends_its_console_sessions_reads_commands_and_streams(make) -> None:
    admin = make()
    _register(admin)
    made = admin.post("/v1/tokens", json={"name": "on call", "scopes": ["read", "command"]}, headers=_h(ADMIN)).json()
    console = make(app=admin.app)
    csrf = _login(console, made["token"])
    assert console.get("/ui/api/runs").status_code == 200
    assert console.post("/ui/api/runs/run-1/checkpoint", json={}, headers={CSRF_HEADER: csrf}).status_code == 200

    def revoke() -> None:
        assert admin.delete(f"/v1/tokens/{made['id']}", headers=_h(ADMIN)).status_code == 200

    events, ended = _read_stream(console, "/ui/api/stream", during=revoke)
    assert ended and [kind for kind, _ in events][:1] == ["runs"]
    assert console.get("/ui/api/runs").status_code == 401
    r = console.post("/ui/api/runs/run-1/pause", json={}, headers={CSRF_HEADER: csrf})
    assert r.status_code == 401 and r.json()["detail"] == "not signed in to the console (POST /ui/login with an operator token)"
    assert console.get("/ui/api/session").json() == {"signed_in": False, "auth_required": True}
    assert not admin.get("/v1/runs/run-1", headers=_h(ADMIN)).json()["desired"]["paused"]
    assert len(admin.app.state.console_sessions) == 0


def test_a_console_session_ends_when_its_token_expires(make) -> None:
    now = [1_000.0]
    admin = make(clock=lambda: now[0])
    made = admin.post("/v1/tokens", json={"scopes": ["read"], "ttl_s": 60}, headers=_h(ADMIN)).json()
    console = make(app=admin.app)
    _login(console, made["token"])
    assert console.get("/ui/api/runs").status_code == 200
    now[0] = 1_060.0
    assert console.get("/ui/api/runs").status_code == 401
    assert console.get("/ui/api/events").status_code == 401


# -- sessions per token ----------------------------------------------------------------------------
def test_logins_never_end_another_tokens_session(make) -> None:
    first = make()
    first.app.state.console_sessions = ConsoleSessions(capacity=8)
    operator = make(app=first.app)
    _login(operator, ADMIN)
    reader = make(app=first.app)
    cookies = []
    for _ in range(40):
        reader.cookies.clear()
        _login(reader, READER)
        cookies.append(reader.cookies[COOKIE])
    assert operator.get("/ui/api/runs").status_code == 200
    # the reader keeps its newest sessions (7 fit beside the operator's), its oldest ended
    statuses = []
    for sid in cookies:
        reader.cookies.clear()
        reader.cookies.set(COOKIE, sid, path="/ui")
        statuses.append(reader.get("/ui/api/runs").status_code)
    assert statuses == [401] * 33 + [200] * 7
    # with every place held by other tokens, a sign-in is refused instead of ending one of them
    hooks = make(app=first.app)
    first.app.state.console_sessions = ConsoleSessions(capacity=2)
    _login(operator, ADMIN)
    _login(reader, READER)
    r = hooks.post("/ui/login", json={"token": HOOKS})
    assert r.status_code == 429
    assert r.json()["detail"] == "the console holds 2 sessions, its limit: sign out elsewhere or wait for sessions to expire"
    assert operator.get("/ui/api/runs").status_code == 200 and reader.get("/ui/api/runs").status_code == 200


def test_a_token_holds_at_most_sixteen_sessions_its_oldest_ends_first(make) -> None:
    c = make()
    sids = []
    for _ in range(17):
        c.cookies.clear()
        _login(c, READER)
        sids.append(c.cookies[COOKIE])
    alive = []
    for sid in sids:
        c.cookies.clear()
        c.cookies.set(COOKIE, sid, path="/ui")
        alive.append(c.get("/ui/api/runs").status_code)
    assert alive == [401] + [200] * 16


# -- failed sign-ins ---------------------------------------------------------------------------------
def test_failed_sign_ins_are_limited_per_address_with_retry_after(make) -> None:
    attacker = make()
    statuses = [attacker.post("/ui/login", json={"token": f"wrong-token-{i:04d}"}).status_code for i in range(30)]
    assert statuses == [401] * 10 + [429] * 20
    r = attacker.post("/ui/login", json={"token": ADMIN})  # locked out: not even the right token is checked
    assert r.status_code == 429 and r.headers["Retry-After"] == "6"
    assert r.json()["detail"] == "too many failed sign-ins; try again in 6 s"
    # another address signs in
    colleague = make(app=attacker.app, client=("10.0.0.2", 5000))
    _login(colleague, ADMIN)


def test_the_login_limiter_refills_per_address_and_in_all() -> None:
    now = [0.0]
    limiter = LoginLimiter(burst=3, refill_s=10.0, burst_total=5, refill_total_s=2.0, clock=lambda: now[0])
    for _ in range(3):
        assert limiter.retry_after("a") == 0.0
        limiter.failed("a")
    assert limiter.retry_after("a") == 10.0 and limiter.retry_after("b") == 0.0  # "a" empty; the total holds 2
    now[0] = 4.0  # "a" refilled to 0.4, the total to 4
    assert limiter.retry_after("a") == pytest.approx(6.0)
    for address in ("b", "b", "c", "c"):
        limiter.failed(address)
    assert limiter.retry_after("d") == pytest.approx(2.0)  # the total is empty: everyone waits for it
    now[0] = 6.0  # the total refilled to 1, "b" to 1.2, "a" to 0.6
    assert limiter.retry_after("d") == 0.0 and limiter.retry_after("b") == 0.0
    assert limiter.retry_after("a") == pytest.approx(4.0)


def test_the_login_limiter_tracks_a_bounded_number_of_addresses() -> None:
    limiter = LoginLimiter(burst=1, refill_s=60.0, burst_total=100, addresses=2, clock=lambda: 0.0)
    for address in ("a", "b", "c"):
        limiter.failed(address)
    assert [limiter.retry_after(a) for a in ("a", "b", "c")] == [0.0, 60.0, 60.0]  # "a", the oldest, forgotten


# -- streams ---------------------------------------------------------------------------------------
def _until_released(sessions: ConsoleSessions) -> int:
    import time

    for _ in range(200):  # the server releases a closed stream's place when its task ends
        if sessions.streams == 0:
            break
        time.sleep(0.05)
    return sessions.streams


def test_streams_are_capped_per_session_and_in_all_with_429(make) -> None:
    import contextlib

    c = make()
    _login(c, READER)
    with contextlib.ExitStack() as stack:
        opened = [stack.enter_context(c.stream("GET", "/ui/api/stream")).status_code for _ in range(6)]
        assert opened == [200] * 6
        with c.stream("GET", "/ui/api/stream") as r:
            assert r.status_code == 429
            assert json.loads(r.read())["detail"] == ("this console session has 6 live-update streams open, its limit: "
                                                      "close a page (or sign in again from another browser)")
        other = make(app=c.app)
        _login(other, READER)
        with other.stream("GET", "/ui/api/stream") as r:
            assert r.status_code == 200  # another session has its own places
    assert _until_released(c.app.state.console_sessions) == 0
    with c.stream("GET", "/ui/api/stream") as r:
        assert r.status_code == 200  # the places came back
    c.app.state.console_sessions = sessions = ConsoleSessions(streams_total=2)
    holders = [make(app=c.app) for _ in range(3)]
    for h in holders:
        _login(h, READER)
    with holders[0].stream("GET", "/ui/api/stream") as a, holders[1].stream("GET", "/ui/api/runs") as b:
        assert a.status_code == 200 and b.status_code == 200
        with holders[1].stream("GET", "/ui/api/stream") as b2, holders[2].stream("GET", "/ui/api/stream") as x:
            assert b2.status_code == 200 and x.status_code == 429
            assert json.loads(x.read())["detail"] == "the console serves 2 live-update streams, its limit: try again later"
    assert _until_released(sessions) == 0


def test_the_runs_list_is_built_once_for_every_stream_not_once_per_stream(make, monkeypatch) -> None:
    c = make()
    fleet = c.post("/v1/tokens", json={"scopes": ["agent"], "job": "*"}, headers=_h(ADMIN)).json()["token"]
    for i in range(10):
        body = {"job": "job-a", "run": f"run-{i}", "world_size": 1, "ranks": []}
        assert c.post("/v1/runs", json=body, headers=_h(fleet)).status_code == 200
    _login(c, READER)
    monkeypatch.setattr(ui_streams, "_RUNS_EVERY_S", 3600.0)  # one interval for the whole test
    built = []
    summary = runstate.RunState.summary
    monkeypatch.setattr(runstate.RunState, "summary", lambda st: built.append(st.run) or summary(st))
    seen = []
    for _ in range(5):
        events, _ = _read_stream(c, "/ui/api/stream", until=lambda evs: any(kind == "runs" for kind, _ in evs))
        seen.append([r["run"] for kind, rows in events if kind == "runs" for r in rows])
    assert seen == [sorted(f"run-{i}" for i in range(10))] * 5
    assert sorted(built) == sorted(f"run-{i}" for i in range(10))  # 10 builds, not 50


def test_a_burst_of_audit_events_does_not_rebuild_the_run_status_per_event(make, monkeypatch) -> None:
    c = make()
    _register(c)
    _login(c, READER)
    monkeypatch.setattr(ui_streams, "_TICK_S", 3600.0)  # the status is looked at once, at the start
    built = []
    summary = runstate.RunState.summary
    monkeypatch.setattr(runstate.RunState, "summary", lambda st: built.append(st.run) or summary(st))
    burst = [{"id": 1000 + i, "run": "run-1", "kind": "note", "actor": "test", "reason": f"event {i}", "data": {}}
             for i in range(300)]

    def publish() -> None:
        built.clear()
        c.portal.call(c.app.state.controller.events_hub.publish, burst)

    events, _ = _read_stream(c, "/ui/api/runs/run-1/stream", during=publish,
                             until=lambda evs: sum(kind == "audit" for kind, _ in evs) == len(burst))
    assert [data["id"] for kind, data in events if kind == "audit"] == [e["id"] for e in burst]
    assert built == []  # (before: the status was rebuilt and compared after each of the 300 events)


# -- Origin --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("origin", "external", "status"), [
    ("http://127.0.0.1:8000", "", 200),
    ("https://127.0.0.1:8000", "", 403),  # another scheme on the same host and port
    ("http://127.0.0.1", "", 403),  # another port (80)
    ("http://127.0.0.1:8000.evil.example", "", 403),
    ("null", "", 403),
    ("https://tg.example", "https://tg.example", 200),  # the public address behind a TLS proxy
    ("https://tg.example:443", "https://tg.example", 200),
    ("http://tg.example", "https://tg.example", 403),
    ("http://[::1", "", 403),  # no URL at all (urlsplit raised: a 500 before)
    ("http://[vx.x]", "", 403),
])
def test_the_origin_must_match_in_scheme_host_and_port(tmp_path, origin: str, external: str, status: int) -> None:
    settings = Settings(db=tmp_path / "tg.db", external_url=external, **TOKENS)
    with TestClient(create_app(settings), base_url=BASE) as c:
        r = c.post("/ui/login", json={"token": ADMIN}, headers={"Origin": origin})
        assert r.status_code == status, r.text
        if status == 403:
            assert r.json()["detail"] == ("cross-origin request refused: the Origin's scheme, host and port must be this "
                                          "controller's (behind a proxy, set TRAINGUARD_EXTERNAL_URL to the public address)")


# -- every console route against every session ----------------------------------------------------
#: (method, path) -> the scopes a session needs (empty: any signed-in session). An action
#: (``{command}``) is checked with ``pause``, whose scope is ``command``.
CONSOLE_NEEDS: dict[tuple[str, str], frozenset[str]] = {
    **{("GET", p): frozenset({"read"}) for p in (
        "/ui/api/runs", "/ui/api/runs/{run}", "/ui/api/runs/{run}/incidents", "/ui/api/runs/{run}/alerts",
        "/ui/api/events", "/ui/api/stream", "/ui/api/runs/{run}/stream", "/ui/api/commands")},
    ("POST", "/ui/api/runs/{run}/{command}/preview"): frozenset({"command"}),
    ("POST", "/ui/api/runs/{run}/{command}"): frozenset({"command"}),
    ("DELETE", "/ui/api/runs/{run}"): frozenset({"command"}),
    ("POST", "/ui/logout"): frozenset(),
}
#: The pages (one static shell, no data), the session probe and the sign-in itself.
CONSOLE_PUBLIC = {("GET", "/"), ("GET", "/ui"), ("GET", "/ui/runs/{run}"), ("GET", "/ui/audit"), ("GET", "/ui/api/session"),
                  ("POST", "/ui/login")}
_SCOPED = {"read": "read-only-token-1", "command": "command-only-token", "webhooks": "hooks-only-token-1"}


def _console_call(c: TestClient, method: str, path: str, csrf: str | None) -> int:
    url = path.replace("{run}", "run-1").replace("{command}", "pause")
    headers = {CSRF_HEADER: csrf} if csrf else {}
    with c.stream(method, url, headers=headers, json={} if method != "GET" else None) as r:  # (a stream: status, closed)
        return r.status_code


def test_every_console_route_needs_a_session_with_its_scope_and_changes_need_the_csrf_token(tmp_path: Path) -> None:
    from tests.service.test_service_deps import app_routes

    routes = {r for r in app_routes(tmp_path) if r[1] == "/" or r[1].startswith("/ui")}
    assert routes - CONSOLE_PUBLIC == set(CONSOLE_NEEDS), "a console route is missing from CONSOLE_NEEDS"
    tokens = {"operator_tokens": tuple(f"{t}:{s}" for s, t in _SCOPED.items()), "agent_tokens": (AGENT,)}
    app = create_app(Settings(db=tmp_path / "tg.db", **tokens))
    wrong: list[str] = []
    with TestClient(app, base_url=BASE) as c:
        _register(c)
        assert c.post("/ui/login", json={"token": AGENT}).status_code == 403  # agents never sign in
        for route in CONSOLE_NEEDS:
            method, path = route
            c.cookies.clear()
            if (status := _console_call(c, method, path, None)) != 401:
                wrong.append(f"{method} {path} without a session: {status}, not 401")
            for scope, token in _SCOPED.items():
                csrf = _login(c, token)  # (a session of its own for each call: a sign-out ends it)
                allowed = not CONSOLE_NEEDS[route] or scope in CONSOLE_NEEDS[route]
                if method != "GET" and (status := _console_call(c, method, path, "not-the-csrf-token")) != 403:
                    wrong.append(f"{method} {path} with a wrong CSRF token: {status}, not 403")
                status = _console_call(c, method, path, csrf)
                if allowed == (status in (401, 403)):
                    wrong.append(f"{method} {path} with a {scope} session: {status}")
    assert not wrong, "\n".join(wrong)
