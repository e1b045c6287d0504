"""A JSON body with an unpaired surrogate escape ("\\ud800": valid JSON, not encodable as UTF-8)
is answered 422 with the reason, never 500, and changes nothing (a pair of escapes is text:
``tests/service/test_service_json_text.py``)."""

from __future__ import annotations

import json
from typing import Any, Callable

import pytest

from tests.service.conftest import register

_H = {"content-type": "application/json"}
_LONE = "\\ud800"  # the six characters of the JSON escape


@pytest.mark.parametrize(("method", "url", "body", "loc"), [
    ("POST", "/v1/runs", '{"job":"job-a","run":"run-2","world_size":1,"agent_version":"%s"}' % _LONE, ["body", "agent_version"]),
    ("POST", "/v1/runs", '{"job":"job-a","run":"run-2","world_size":1,"ranks":[{"rank":0,"local_rank":0,"host":"%s","port":9100}]}' % _LONE,
     ["body", "ranks", 0, "host"]),
    ("POST", "/v1/runs/run-1/pause", '{"reason":"%s"}' % _LONE, ["body", "reason"]),
    ("POST", "/v1/runs/run-1/lr-scale", '{"scale":0.5,"reason":"x%s"}' % _LONE, ["body", "reason"]),
    ("POST", "/v1/runs/run-1/finish", '{"step":3,"reason":"%s"}' % _LONE, ["body", "reason"]),
    ("POST", "/v1/webhooks", '{"url":"http://127.0.0.1:9/%s"}' % _LONE, ["body", "url"]),
    ("POST", "/v1/webhooks", '{"url":"http://127.0.0.1:9/x","secret":"%saaaaaaaaaaaaaaaaaaaa"}' % _LONE, ["body", "secret"]),
])
def test_unpaired_surrogate_is_422(app_factory: Callable[..., Any], method: str, url: str, body: str, loc: list[Any]) -> None:
    with app_factory() as c:
        register(c, world_size=1)
        r = c.request(method, url, content=body.encode(), headers=_H)
        assert r.status_code == 422, r.text
        detail = json.loads(r.content)["errors"]
        assert [d["loc"] for d in detail] == [loc]
        if loc[-1] == "secret":  # a secret is never repeated
            assert detail[0]["input"] == "(a secret: not repeated)" and "aaaaaaaaaaaaaaaaaaaa" not in r.text
        else:
            assert detail[0]["input"].endswith("\ud800") or "\ud800" in detail[0]["input"]
        run = c.get("/v1/runs/run-1").json()
        assert (run["status"], run["desired_generation"]) == ("registered", 0)
        assert [r["run"] for r in c.get("/v1/runs").json()] == ["run-1"]
        assert c.get("/v1/webhooks").json() == []



def test_a_422_repeats_at_most_the_start_of_a_large_refused_value(app_factory: Callable[..., Any]) -> None:
    from trainguard.service.app import ECHO_LIMIT

    with app_factory() as c:
        long = "x" * 200_000  # far past agent_version's 64 characters, well inside the body limit
        r = c.post("/v1/runs", json={"job": "job-a", "run": "run-2", "world_size": 1, "agent_version": long})
        assert r.status_code == 422, r.text[:300]
        assert len(r.content) < 4 * ECHO_LIMIT  # the answer, not the 200 KB sent
        (err,) = r.json()["errors"]
        assert err["loc"] == ["body", "agent_version"]
        shown = json.dumps(long)
        assert err["input"] == f"{shown[:ECHO_LIMIT]}... ({len(shown):,} characters in all)"
        assert c.get("/v1/runs").json() == []


@pytest.mark.parametrize("url", ["/v1/webhooks", "/v1/tokens", "/v1/alertmanager", "/v1/runs/run-1/finish",
                                 "/v1/runs/run-1/lr-scale", "/ui/api/runs/run-1/pause", "/ui/api/runs/run-1/pause/preview"])
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/octet-stream"])
def test_a_body_that_is_not_utf8_and_not_sent_as_json_is_a_422_with_its_bytes_replaced(
        app_factory: Callable[..., Any], url: str, content_type: str | None) -> None:
    # (such a body is validated as raw bytes; repeating them in the 422 decoded them as UTF-8: a 500)
    with app_factory() as c:
        register(c, world_size=1)
        csrf = c.get("/ui/api/session").json()["csrf"]  # (no tokens: an anonymous console session)
        headers = {"X-CSRF-Token": csrf} | ({"content-type": content_type} if content_type else {})
        r = c.post(url, content=b"\xff\xfe{\xe9", headers=headers)
        assert r.status_code == 422, r.text
        (err,) = r.json()["errors"]
        assert err["loc"] == ["body"] and err["input"] == "\ufffd\ufffd{\ufffd"
        assert r.json()["detail"] == f"the request does not validate: body: {err['msg']}"
        run = c.get("/v1/runs/run-1").json()
        assert (run["status"], run["desired_generation"]) == ("registered", 0)


@pytest.mark.parametrize("body", [
    {"url": "http://127.0.0.1:9/hook", "secret": "short-pw-123"},  # too short
    {"url": "http://127.0.0.1:9/hook", "secret": ["a-secret-of-enough-length"]},  # not a string
    {"url": "http://127.0.0.1:9/hook", "secret": "s" * 257},  # too long
])
def test_a_422_never_repeats_a_refused_webhook_secret(app_factory: Callable[..., Any], body: dict[str, Any]) -> None:
    with app_factory() as c:
        r = c.post("/v1/webhooks", json=body)
        assert r.status_code == 422, r.text
        (err,) = r.json()["errors"]
        assert err["loc"] == ["body", "secret"] and err["input"] == "(a secret: not repeated)"
        secret = body["secret"] if isinstance(body["secret"], str) else body["secret"][0]
        assert secret[:12] not in r.text
        assert c.get("/v1/webhooks").json() == []
