"""Integers beyond SQLite's signed 64-bit INTEGER are refused with 422, never stored (500); what an agent
names (metrics, layers, ranks, shards) and its figures are held to their bounds."""

from __future__ import annotations

import json
from typing import Any, Callable

import pytest

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


def _refused(client: Any, url: str, body: dict[str, Any], loc: list[Any]) -> dict[str, Any]:
    """Post ``body``; assert a 422 whose problems name ``loc`` first, in an answer that strict JSON
    parsers read (NaN and Infinity as strings), and return the answer."""
    r = client.post(url, json=body)
    assert r.status_code == 422, r.text
    answer = json.loads(r.content, parse_constant=lambda c: pytest.fail(f"bare {c} in the answer"))
    assert answer["errors"][0]["loc"][:len(loc)] == loc, answer
    return answer


def test_what_the_agent_names_is_printable_bounded_and_within_the_run(app_factory: Callable[..., Any]) -> None:
    """Metric names are Prometheus names of at most 128 characters; a desync layer's name is
    printable, its difference not negative (NaN stays) and its ranks within the run; memory,
    pre-flight and quarantine figures within their bounds; every refusal changes nothing."""
    with app_factory() as client:
        register(client, world_size=2)
        url = "/v1/runs/run-1/reports"
        for name in ("", "a\nb", "1abc", "x" * 129, "trainguard loss", "m" * 1_000_000):
            _refused(client, url, _report(values={name: 1.0}), ["values"])
        layer = {"kind": "grad", "layer": "blocks.0", "rel_diff": 0.5, "ranks": [1]}
        for bad, loc in (({"layer": "blocks\n0"}, ["desync", 0, "layer"]), ({"layer": "a\u202eb"}, ["desync", 0, "layer"]),
                         ({"rel_diff": -0.5}, ["desync", 0, "rel_diff"]), ({"ranks": [1_000_000]}, ["desync", 0, "ranks", 0]),
                         ({"ranks": [-1]}, ["desync", 0, "ranks", 0])):
            _refused(client, url, _report(desync=[layer | bad]), loc)
        r = client.post(url, json=_report(desync=[layer | {"ranks": [2]}]))  # within the bound, beyond the run
        assert r.status_code == 422 and "the run's world_size is 2" in r.json()["detail"], r.text
        assert client.get("/v1/runs/run-1").json()["reports"] == 0
        ok = _report(values={"n" * 128: 1.0}, desync=[layer | {"rel_diff": "NaN", "ranks": [0, 1]}])
        assert client.post(url, json=ok).status_code == 200
        owner = {"owner": "blocks.0", "bytes_per_step": 1.0, "tensors": 1}
        for body, loc in (({"rank": 10**20, "step": 1, "steps": 1}, ["body", "rank"]),
                          ({"step": 1, "steps": 10**20}, ["body", "steps"]),
                          ({"step": 1, "steps": 1, "owners": [owner | {"tensors": 10**20}]}, ["body", "owners", 0, "tensors"]),
                          ({"step": 1, "steps": 1, "owners": [owner | {"owner": "a\x00"}]}, ["body", "owners", 0, "owner"])):
            _refused(client, "/v1/runs/run-1/memory-report", body, loc)
        for body, loc in (({"rank": 10**20, "seconds": 1.0, "checks": []}, ["body", "rank"]),
                          ({"seconds": 1e300, "checks": []}, ["body", "seconds"]),
                          ({"seconds": 1.0, "checks": [{"name": "a\nb", "status": "pass"}]}, ["body", "checks", 0, "name"])):
            _refused(client, "/v1/runs/run-1/preflight", body, loc)
        for indices in ([-1], [3, -10**18]):
            _refused(client, "/v1/runs/run-1/quarantine", {"step": 1, "samples": [{"shard": "/d/s0", "indices": indices}]},
                     ["body", "samples", 0, "indices"])
        _refused(client, "/v1/runs/run-1/quarantine", {"step": 1, "samples": [{"shard": "/d/\x1bs0", "indices": [1]}]},
                 ["body", "samples", 0, "shard"])
        bad_local = {"job": "job-a", "run": "run-2", "world_size": 2, "ranks": [
            {"rank": 0, "local_rank": 0, "host": "h", "port": 9100}, {"rank": 1, "local_rank": 2, "host": "h", "port": 9101}]}
        r = client.post("/v1/runs", json=bad_local)
        assert r.status_code == 422 and "local_rank must be < world_size 2" in r.json()["detail"], r.text
        assert [run["run"] for run in client.get("/v1/runs").json()] == ["run-1"]


def test_a_422_is_strict_json_and_lists_at_most_twenty_problems(app_factory: Callable[..., Any]) -> None:
    with app_factory() as client:
        register(client, world_size=1)
        for token in (b"NaN", b"Infinity", b"-Infinity"):  # the bare tokens Python's json reads and writes
            r = client.post("/v1/runs/run-1/lr-scale", content=b'{"scale": %s}' % token,
                            headers={"content-type": "application/json"})
            assert r.status_code == 422, r.text
            answer = json.loads(r.content, parse_constant=lambda c: pytest.fail(f"bare {c} in the answer"))
            assert answer["errors"][0]["input"] == token.decode()  # as the wire's string
        from trainguard.service.app import ERRORS_SHOWN

        answer = _refused(client, "/v1/runs/run-1/reports", _report(values={f"bad name {k}": 1.0 for k in range(900)}),
                          ["values"])
        assert len(answer["errors"]) == ERRORS_SHOWN == 20
        assert answer["detail"].endswith("(and 897 more)")


def test_a_commands_reason_holds_no_control_character_but_tab_and_newline(app_factory: Callable[..., Any]) -> None:
    """A reason is printed by ``trainguard events`` on operators' terminals: ESC sequences, CR and
    NUL would act on them, a bidirectional override would reverse the text."""
    with app_factory() as client:
        register(client, world_size=1)
        for reason in ("evil\x1b[31mRED", "a\rOVERWRITE", "a\x00b", "rtl\u202eevil", "\x9b2J"):
            _refused(client, "/v1/runs/run-1/checkpoint", {"reason": reason}, ["body", "reason"])
        assert client.get("/v1/runs/run-1").json()["desired_generation"] == 0
        r = client.post("/v1/runs/run-1/checkpoint", json={"reason": "loss spike\n\tsee the dashboard; 損失"})
        assert r.status_code == 200, r.text
        assert client.get("/v1/runs/run-1").json()["desired"]["reason"] == "loss spike\n\tsee the dashboard; 損失"


def test_a_boolean_report_value_is_422_naming_it_and_stores_nothing(app_factory: Callable[..., Any]) -> None:
    with app_factory() as client:
        register(client, world_size=2)
        for body, where in ((_report(values={"trainguard_loss": True}), "values.trainguard_loss"),
                            (_report(ranks={"loss": [1.5, False]}), "ranks.loss.list.1")):
            r = client.post("/v1/runs/run-1/reports", json=body)
            assert r.status_code == 422, r.text
            assert r.json()["detail"] == f"the request does not validate: {where}: Input should be a number, not a boolean"
        assert client.get("/v1/runs/run-1").json()["reports"] == 0
        r = client.post("/v1/runs/run-1/reports", json=_report(values={"trainguard_loss": 1, "trainguard_grad_norm": "NaN"}))
        assert r.status_code == 200, r.text  # numbers (an integer, the wire's NaN) are values
