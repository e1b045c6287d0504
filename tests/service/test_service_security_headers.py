"""Every answer of the controller carries ``X-Content-Type-Options: nosniff``: the API's, the
console's pages and static files, and those of the gates before the routes (authentication, the
body limit, the report ingress that answers reports itself)."""

from __future__ import annotations

import json
from typing import Any, Callable

import pytest

from tests.service.conftest import register

AGENT, READ = "agent-token-nosniff-1", "read-token-nosniff-1"
_REPORT = json.dumps({"job": "job-a", "step_first": 1, "step_last": 1, "time": 1.0,
                      "values": {"trainguard_loss": 2.0}}).encode()


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.mark.parametrize(("method", "url", "body", "token", "status"), [
    ("GET", "/v1/runs", None, READ, 200),
    ("GET", "/v1/runs/nope", None, READ, 404),
    ("GET", "/v1/runs", None, None, 401),  # refused by the authentication gate
    ("GET", "/v1/runs", None, "not-a-token", 401),
    ("POST", "/v1/runs/run-1/pause", b'{"reason": 5}', READ, 403),
    ("POST", "/v1/runs/run-1/reports", _REPORT, AGENT, 200),  # answered by the report ingress itself
    ("POST", "/v1/runs/run-1/reports", b"{", AGENT, 422),
    ("POST", "/v1/runs/run-1/reports", b"x" * (64 << 20), AGENT, 413),  # the body limit
    ("GET", "/ui/", None, None, 200),
    ("GET", "/ui/static/app.js", None, None, 200),
    ("GET", "/healthz", None, None, 200),
    ("GET", "/metrics", None, None, 200),
])
def test_every_answer_says_nosniff(app_factory: Callable[..., Any], method: str, url: str, body: bytes | None,
                                   token: str | None, status: int) -> None:
    with app_factory(agent_tokens=(AGENT,), operator_tokens=(READ + ":read",)) as c:
        register(c, world_size=1, headers=_bearer(AGENT))
        r = c.request(method, url, content=body, headers={"content-type": "application/json",
                                                           **(_bearer(token) if token else {})})
        assert r.status_code == status, r.text[:300]
        assert r.headers.get_list("x-content-type-options") == ["nosniff"]


def test_an_answer_that_sets_the_header_itself_keeps_one() -> None:
    import asyncio

    from trainguard.service.security_headers import NoSniff

    sent: list[dict[str, Any]] = []

    async def app(scope: dict, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"X-Content-Type-Options", b"nosniff"), (b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(NoSniff(app)({"type": "http"}, None, send))
    assert [n.lower() for n, _ in sent[0]["headers"]].count(b"x-content-type-options") == 1
    assert sent[1] == {"type": "http.response.body", "body": b"ok"}
