"""JSON bodies with an unpaired surrogate escape (``service/json_text.py``): every route answers
422 naming where the string lies, before it reads the body, and nothing changes; a pair of
escapes (a character beyond U+FFFF) is text."""

from __future__ import annotations

import json
from typing import Any, Callable

import pytest

from tests.service.conftest import register
from trainguard.service.json_text import unpaired_surrogate

_H = {"content-type": "application/json"}
_LONE = "\\ud800"  # the six characters of the JSON escape


def _alert(labels: str) -> bytes:
    return ('{"version":"4","status":"firing","alerts":[{"status":"firing","labels":%s}]}' % labels).encode()


@pytest.mark.parametrize(("method", "url", "body", "loc"), [
    # Routes whose models hold free-form strings: Alertmanager's labels, a reset's layer names.
    ("POST", "/v1/alertmanager", _alert('{"run":"%s","trainguard_action":"pause"}' % _LONE),
     ["body", "alerts", 0, "labels", "run"]),
    ("POST", "/v1/alertmanager", _alert('{"run":"run-1","trainguard_action":"%s"}' % _LONE),
     ["body", "alerts", 0, "labels", "trainguard_action"]),
    ("POST", "/v1/alertmanager", _alert('{"run":"run-1","x%s":"pause"}' % _LONE),
     ["body", "alerts", 0, "labels", "x\ud800", "[key]"]),
    ("POST", "/v1/runs/run-1/reset-optimizer", ('{"layers":["blocks.0","%s"]}' % _LONE).encode(), ["body", "layers", 1]),
    ("PUT", "/v1/rules", ('{"rules":"rules: []  # %s"}' % _LONE).encode(), ["body", "rules"]),
])
def test_an_unpaired_surrogate_anywhere_in_a_body_is_422_and_changes_nothing(
        app_factory: Callable[..., Any], method: str, url: str, body: bytes, loc: list[Any]) -> None:
    with app_factory() as c:
        register(c, world_size=1)
        rules = c.get("/v1/rules").json()
        for headers in (_H, {}):  # FastAPI parses a body without a content type as JSON too
            r = c.request(method, url, content=body, headers=headers)
            assert r.status_code == 422, r.text
            answer = json.loads(r.content)
            assert [e["loc"] for e in answer["errors"]] == [loc]
            assert answer["errors"][0]["type"] == "string_unicode" and "\ud800" in answer["errors"][0]["input"]
            assert answer["detail"].startswith("the request does not validate: body.")
        run = c.get("/v1/runs/run-1").json()
        assert (run["status"], run["desired_generation"], run["firing"]) == ("registered", 0, [])
        assert c.get("/v1/rules").json() == rules


def test_paired_escapes_and_utf8_are_text(app_factory: Callable[..., Any]) -> None:
    with app_factory() as c:
        register(c, world_size=1)
        r = c.post("/v1/runs/run-1/pause", content=b'{"reason":"\\ud83d\\ude00 and \xf0\x9f\x98\x80"}', headers=_H)
        assert r.status_code == 200, r.text
        assert c.get("/v1/runs/run-1").json()["desired"]["reason"] == "\U0001F600 and \U0001F600"
        # An escaped backslash before "ud800" is six plain characters, not an escape.
        r = c.post("/v1/runs/run-1/resume", content=b'{"reason":"path C:\\\\ud800"}', headers=_H)
        assert r.status_code == 200, r.text
        assert c.get("/v1/runs/run-1").json()["desired"]["reason"] == "path C:\\ud800"


def test_the_scan_finds_the_first_unpaired_surrogate_and_nothing_else() -> None:
    assert unpaired_surrogate(b'{"a": ["x", {"b": "\\udc00"}]}') == (["a", 1, "b"], "\udc00")
    assert unpaired_surrogate(b'{"a": "\\ud83d\\ude00"}') is None  # a pair
    assert unpaired_surrogate(b'{"a": "\\\\ud800"}') is None  # an escaped backslash
    assert unpaired_surrogate(b'{"a": "\\ud800') is None  # no JSON: the route answers that
    deep = b"[" * 100_000 + b'"\\ud800"' + b"]" * 100_000
    assert unpaired_surrogate(deep) is None  # too deep for the parser: left to the route (which refuses it)
    nested = b'{"k":' * 900 + b'"\\ud800"' + b"}" * 900
    loc, text = unpaired_surrogate(nested)
    assert loc == ["k"] * 900 and text == "\ud800"
