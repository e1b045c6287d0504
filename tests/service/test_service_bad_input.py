"""Input that used to crash a route (500) is a client error (4xx) with a message: deeply nested
rules, malformed Last-Event-ID headers, per-rank vectors that do not fit the world size, and
integers sent as strings (the wire format does not coerce)."""

from __future__ import annotations

import pytest

from tests.service.conftest import register

DEEP = "[" * 50_000 + "]" * 50_000


def test_deeply_nested_rules_are_refused_and_the_old_rules_stay(app_factory) -> None:
    with app_factory() as c:
        before = c.get("/v1/rules").json()["version"]
        r = c.put("/v1/rules", content=DEEP)
        assert r.status_code == 422 and "nested too deeply" in r.json()["reasons"][0]
        r = c.post("/v1/rules/test", json={"rules": DEEP, "reports": []})
        assert r.status_code == 422 and "nested too deeply" in r.json()["reasons"][0]
        assert c.get("/v1/rules").json()["version"] == before


@pytest.mark.parametrize("header", ["9" * 5000, "²", "12a", "-1"])
def test_malformed_last_event_id_is_a_400(app_factory, header: str) -> None:
    with app_factory() as c:
        r = c.get("/v1/events/stream", headers={"Last-Event-ID": header.encode("latin-1")})
        assert r.status_code == 400 and "Last-Event-ID" in r.json()["detail"]


def test_rules_test_vectors_longer_than_world_size_are_a_422(app_factory) -> None:
    report = {"job": "test", "step_first": 1, "step_last": 1, "time": 1.0, "ranks": {"step_time_s": [1.0, 2.0, 3.0]}}
    with app_factory() as c:
        r = c.post("/v1/rules/test", json={"world_size": 2, "reports": [report]})
        assert r.status_code == 422 and "has 3 values; world_size is 2" in r.text
        ok = dict(report, ranks={"step_time_s": [1.0, 2.0]})
        assert c.post("/v1/rules/test", json={"world_size": 2, "reports": [ok]}).status_code == 200


@pytest.mark.parametrize("field,value", [("step_first", "1"), ("step_last", "1"), ("applied_generation", "0"), ("step_last", 1.5),
                                         ("step_last", True)])
def test_integers_sent_as_strings_booleans_or_fractions_are_refused(app_factory, field: str, value: object) -> None:
    with app_factory() as c:
        register(c, world_size=1)
        body = {"job": "job-a", "step_first": 1, "step_last": 1, "time": 1.0, "values": {}} | {field: value}
        r = c.post("/v1/runs/run-1/reports", json=body)
        assert r.status_code == 422, r.text
        assert c.get("/v1/runs/run-1").json()["reports"] == 0
        assert c.post("/v1/runs/run-1/acks", json={"generation": "0", "step": 1}).status_code == 422
