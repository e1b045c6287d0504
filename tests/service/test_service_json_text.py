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


@pytest.mark.parametrize(("method", "url", "body", "key"), [
    ("POST", "/v1/runs/run-1/lr-scale", '{"scale":0.5,"scale":5}', "scale"),
    ("POST", "/v1/runs/run-1/pause", '{"reason":"a","reason":"b"}', "reason"),
    ("POST", "/v1/alertmanager", _alert('{"run":"run-1","trainguard_action":"stop","trainguard_action":"pause"}').decode(),
     "trainguard_action"),
    ("POST", "/v1/runs", '{"job":"job-a","run":"run-2","run":"run-3","world_size":1}', "run"),
    ("POST", "/v1/webhooks", '{"url":"http://127.0.0.1:9/a","url":"http://127.0.0.1:9/b"}', "url"),
])
def test_a_key_named_twice_in_one_object_is_422_and_changes_nothing(
        app_factory: Callable[..., Any], method: str, url: str, body: str, key: str) -> None:
    # (Python's parser took the last of the two: lr-scale 5, not the 0.5 a reader of the body sees first)
    with app_factory() as c:
        register(c, world_size=1)
        r = c.request(method, url, content=body.encode(), headers=_H)
        assert r.status_code == 422, r.text
        (err,) = r.json()["errors"]
        assert (err["type"], err["loc"], err["input"]) == ("duplicate_key", ["body"], key)
        assert r.json()["detail"] == f"the request does not validate: body: names the key {key!r} twice in one object: send each key once"
        run = c.get("/v1/runs/run-1").json()
        assert (run["status"], run["desired_generation"]) == ("registered", 0)
        assert [r["run"] for r in c.get("/v1/runs").json()] == ["run-1"]
        assert c.get("/v1/webhooks").json() == []


def test_the_duplicate_key_scan_looks_into_every_object_and_leaves_other_bodies_to_the_route() -> None:
    from trainguard.service.json_text import duplicate_key

    assert duplicate_key(b'{"a":{"b":1,"c":{"d":[{"e":1,"e":2}]}}}') == "e"
    assert duplicate_key(b'[{"x":1,"y":{"x":2}},{"x":3}]') is None  # the same key in different objects
    assert duplicate_key(b'{"a":1,"A":2}') is None
    assert duplicate_key(b"{" * 100_000) is None  # no JSON (and far too deep): the route answers it
    assert duplicate_key(b"\xff") is None
