"""Every route of the controller against every kind of caller, on a real ``trainguard serve``: the
route table is read from the app, and each route must be listed in ``NEEDS`` with the scopes that
admit it (a new route without a scope check, or with another one, fails here). A caller without
one of those scopes gets 403, no token or an unknown one 401, and an agent token of another run
is refused on the run's agent routes (403, or 404 as for a run it never registered)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from trainguard.protocol.commands import REGISTRY
from trainguard.service.app import create_app
from trainguard.service.config import Settings

#: One operator token per scope, the agent token owning run-a and the one owning run-b.
OPERATORS = {scope: f"{scope}-only-token-1" for scope in ("read", "command", "rules", "webhooks", "tokens")}
OWNER, OTHER = "agent-owner-token-1", "agent-other-token-1"
ENV = {"TRAINGUARD_OPERATOR_TOKENS": ",".join(f"{t}:{s}" for s, t in OPERATORS.items()),
       "TRAINGUARD_AGENT_TOKENS": f"{OWNER}:run-a,{OTHER}:run-b"}
_AGENT_ROUTES = ["/v1/runs/{run}/reports", "/v1/runs/{run}/acks", "/v1/runs/{run}/preflight",
                 "/v1/runs/{run}/memory-report", "/v1/runs/{run}/quarantine", "/v1/runs/{run}/finish"]
#: (method, path) -> the scopes admitting it.
NEEDS: dict[tuple[str, str], frozenset[str]] = {
    ("POST", "/v1/runs"): frozenset({"agent"}),
    **{("POST", path): frozenset({"agent"}) for path in _AGENT_ROUTES},
    ("GET", "/v1/runs/{run}/desired"): frozenset({"agent", "read"}),
    **{("GET", path): frozenset({"read"}) for path in (
        "/v1/runs", "/v1/runs/{run}", "/v1/runs/{run}/incidents", "/v1/runs/{run}/events", "/v1/alerts",
        "/v1/events/stream", "/v1/rules", "/v1/sd/targets")},
    ("DELETE", "/v1/runs/{run}"): frozenset({"command"}),
    **{("POST", f"/v1/runs/{{run}}/{spec.url}"): frozenset({"command"}) for spec in REGISTRY if spec.operator},
    ("POST", "/v1/alertmanager"): frozenset({"command"}),
    ("PUT", "/v1/rules"): frozenset({"rules"}),
    ("POST", "/v1/rules/test"): frozenset({"rules"}),
    **{(m, p): frozenset({"webhooks"}) for m, p in (
        ("POST", "/v1/webhooks"), ("GET", "/v1/webhooks"), ("DELETE", "/v1/webhooks/{webhook_id}"),
        ("GET", "/v1/webhooks/{webhook_id}/deliveries"))},
    **{(m, p): frozenset({"tokens"}) for m, p in (("POST", "/v1/tokens"), ("GET", "/v1/tokens"), ("DELETE", "/v1/tokens/{token_id}"))},
}
#: Routes anyone may call (health, Prometheus' scrape, the API document) and the console's, which
#: sessions authorise (tests/ui/test_ui_sessions.py).
PUBLIC = {("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/metrics"), ("GET", "/openapi.json"), ("HEAD", "/openapi.json"),
          ("GET", "/docs")}


def app_routes(tmp_path: Path) -> set[tuple[str, str]]:
    """Every (method, path) the app routes to, included routers walked."""
    app = create_app(Settings(db=tmp_path / "routes.db"))

    def walk(routes: list[Any]) -> Any:
        for route in routes:
            if hasattr(route, "original_router"):
                yield from walk(route.original_router.routes)
            elif getattr(route, "methods", None):
                yield from ((method, route.path) for method in route.methods)

    return set(walk(app.routes))


def test_every_route_is_listed_with_the_scopes_that_admit_it(tmp_path: Path) -> None:
    routes = {r for r in app_routes(tmp_path) if not r[1].startswith("/ui") and r[1] != "/"}
    assert routes - PUBLIC == set(NEEDS), "a route is missing from NEEDS (or NEEDS lists one that is gone)"


_BODIES = {
    "/v1/runs": {"job": "job-a", "run": "run-a", "world_size": 1},
    "/v1/runs/{run}/reports": {"job": "job-a", "step_first": 1, "step_last": 1, "time": 1.0},
    "/v1/runs/{run}/acks": {"generation": 0, "step": 1},
    "/v1/runs/{run}/preflight": {"seconds": 1, "checks": []},
    "/v1/runs/{run}/memory-report": {"step": 1, "steps": 1},
    "/v1/runs/{run}/quarantine": {"step": 1},
    "/v1/runs/{run}/finish": {"step": 1},
    "/v1/alertmanager": {"version": "4", "alerts": []},
    "/v1/rules/test": {"reports": []},
}


def _call(c: httpx.Client, method: str, path: str, token: str | None) -> int:
    url = path.replace("{run}", "run-a").replace("{webhook_id}", "1").replace("{token_id}", "1")
    headers = {"authorization": f"Bearer {token}"} if token else {}
    if path == "/v1/rules" and method == "PUT":
        kwargs: dict[str, Any] = {"content": b"rules: []"}
    else:
        kwargs = {"json": _BODIES.get(path, {})} if method in ("POST", "PUT") else {}
    with c.stream(method, url, headers=headers, **kwargs) as r:  # (an event stream: its status, then closed)
        return r.status_code


def _order(route: tuple[str, str]) -> tuple[int, str, str]:
    """The agent's routes first (its finish last), then reads, then the rest: nothing an allowed
    call changes (a run finished or stopped) turns a later check into another answer."""
    method, path = route
    return (0 if "agent" in NEEDS[route] and not path.endswith("/finish") else 1 if path.endswith("/finish")
            else 2 if method == "GET" else 3, path, method)


def test_each_route_refuses_every_caller_without_its_scope_or_of_another_run(serve: Any, tmp_path: Path) -> None:
    server = serve(tmp_path / "tg.db", env=ENV)
    c = httpx.Client(base_url=server.url, timeout=30)
    assert c.post("/v1/runs", json=_BODIES["/v1/runs"], headers={"authorization": f"Bearer {OWNER}"}).status_code == 200
    wrong: list[str] = []
    for route in sorted(NEEDS, key=_order):
        method, path = route
        needs = NEEDS[route]
        for who, token in [("no token", None), ("unknown token", "unknown-token-12345")]:
            if (status := _call(c, method, path, token)) != 401:
                wrong.append(f"{method} {path} with {who}: {status}, not 401")
        for scope, token in OPERATORS.items():
            status = _call(c, method, path, token)
            if (scope in needs) != (status not in (401, 403)):
                wrong.append(f"{method} {path} with a {scope} token: {status}")
        if "agent" in needs:
            if (status := _call(c, method, path, OTHER)) not in (403, 404):
                wrong.append(f"{method} {path} with another run's agent token: {status}, not 403 or 404")
        status = _call(c, method, path, OWNER)
        if ("agent" in needs and status in (401, 403, 404)) or ("agent" not in needs and status != 403):
            wrong.append(f"{method} {path} with the run's own agent token: {status}")
    assert not wrong, "\n".join(wrong)
