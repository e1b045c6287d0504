"""Integers beyond SQLite's signed 64-bit INTEGER are refused with 422, never stored (500)."""

from __future__ import annotations

from typing import Any, Callable

from tests.service.conftest import register

BIG = 2**63  # one past SQLite's largest INTEGER
OK = 2**63 - 1


def _report(**kw: Any) -> dict[str, Any]:
    return {"job": "job-a", "step_first": 1, "step_last": 1, "time": 1.0} | kw


def test_agent_bodies_with_huge_integers_are_422_and_leave_the_run_untouched(app_factory: Callable[..., Any]) -> None:
    with app_factory() as client:
        register(client, world_size=1)
        for body in (_report(step_first=BIG, step_last=BIG), _report(step_last=BIG), _report(applied_generation=BIG)):
            r = client.post("/v1/runs/run-1/reports", json=body)
            assert r.status_code == 422, r.text
        assert client.post("/v1/runs/run-1/acks", json={"generation": 0, "step": BIG}).status_code == 422
        assert client.post("/v1/runs/run-1/finish", json={"step": BIG}).status_code == 422
        run = client.get("/v1/runs/run-1").json()
        assert (run["reports"], run["last_step"], run["applied_step"], run["status"]) == (0, None, None, "registered")
        # The largest storable values are accepted and read back exactly.
        r = client.post("/v1/runs/run-1/reports", json=_report(step_first=OK, step_last=OK))
        assert r.status_code == 200, r.text
        assert client.post("/v1/runs/run-1/acks", json={"generation": 0, "step": OK}).json()["applied_step"] == OK
        assert client.get("/v1/runs/run-1").json()["last_step"] == OK


def test_query_and_path_integers_beyond_int64_are_422(app_factory: Callable[..., Any]) -> None:
    with app_factory() as client:
        register(client, world_size=1)
        for method, url in (("GET", f"/v1/runs/run-1/events?after={BIG}"), ("GET", f"/v1/alerts?before={BIG}"),
                            ("GET", f"/v1/events/stream?after={BIG}"), ("DELETE", f"/v1/webhooks/{BIG}"),
                            ("GET", f"/v1/webhooks/{BIG}/deliveries"), ("GET", f"/v1/webhooks/{-BIG}/deliveries")):
            r = client.request(method, url)
            assert r.status_code == 422, (url, r.status_code, r.text)
        assert client.get(f"/v1/runs/run-1/events?after={OK}").json() == []
        assert client.delete(f"/v1/webhooks/{OK}").status_code == 404
