"""The report fast path (service.ingress) answers exactly what the FastAPI route answers.

Two controllers on separate databases get the same requests: one as built by ``create_app``
(reports go through ``ReportIngress``), one with that middleware taken out (reports go through the
documented route ``service.routes.runs.post_report``). Every answer (status, body, headers that
matter) and the rejection counters must agree, for good reports and for every kind of bad one.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from pathlib import Path
from typing import Any, Iterator

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import Request

from trainguard.service.app import create_app
from trainguard.service.config import Settings
from trainguard.service.ingress import MAX_RUN_NAME, ReportIngress
from tests.service.conftest import register

AG, AG_BOUND, AG_NEW, OP_READ = "agent-token-ing-1", "agent-token-ing-2", "agent-token-ing-3", "readonly-token-ing"
TOKENS = dict(agent_tokens=(AG, f"{AG_BOUND}:run-b", AG_NEW), operator_tokens=(OP_READ + ":read",))


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _report(step: int, values: dict[str, Any] | None = None, job: str = "job-a", **ranks: list[float]) -> bytes:
    return json.dumps({"job": job, "step_first": step, "step_last": step, "time": 1.0, "values": values or {}, "ranks": ranks}).encode()


@contextlib.contextmanager
def _client(db: Path, *, fast: bool) -> Iterator[TestClient]:
    ticks = itertools.count()
    app = create_app(Settings(db=db, **TOKENS), clock=lambda: 1_000.0 + next(ticks))
    if not fast:
        app.user_middleware = [m for m in app.user_middleware if m.cls is not ReportIngress]
    with TestClient(app) as c:
        register(c, run="run-a", world_size=4, headers=_bearer(AG))
        register(c, run="run-b", world_size=4, headers=_bearer(AG_BOUND))
        yield c


# (path, body, headers): good reports, then every kind of refusal, then good ones again.
LONG_RUN = "r" * (MAX_RUN_NAME + 1)
CASES: list[tuple[str, bytes, dict[str, str]]] = [
    ("/v1/runs/run-a/reports", _report(1, {"trainguard_loss": 2.0, "trainguard_grad_norm_max": 10.0}, loss=[1.0, 2.0, 3.0, 4.0]), _bearer(AG)),
    ("/v1/runs/run-a/reports", _report(2, {"trainguard_grad_norm_max": 5000.0}), _bearer(AG)),  # fires grad_norm_high (a rise)
    ("/v1/runs/run-a/reports", b'{"job":"job-a","step_first":3,"step_last":3,"time":1.0,"values":{"trainguard_loss":NaN}}', _bearer(AG)),
    ("/v1/runs/run-a/reports", _report(4), {}),  # 401: no token
    ("/v1/runs/run-a/reports", _report(4), _bearer("not-a-known-token")),  # 401: unknown token
    ("/v1/runs/run-a/reports", _report(4), _bearer(OP_READ)),  # 403: no agent scope
    ("/v1/runs/run-a/reports", _report(4), _bearer(AG_BOUND)),  # 403: bound to run-b
    ("/v1/runs/run-b/reports", _report(4), _bearer(AG)),  # 403: AG was bound to run-a
    ("/v1/runs/ghost/reports", _report(4), _bearer(AG)),  # 403: bound to run-a (the binding is checked first: as for run-b)
    ("/v1/runs/ghost/reports", _report(4), _bearer(AG_NEW)),  # 404: a token bound to no run yet (as for run-b)
    ("/v1/runs/run-b/reports", _report(4, job="other"), _bearer(AG_BOUND)),  # 409
    ("/v1/runs/run-b/reports", _report(4, loss=[1.0, 2.0]), _bearer(AG_BOUND)),  # 422: vector length
    ("/v1/runs/run-b/reports", b"{not json", _bearer(AG_BOUND)),  # 422: not JSON
    ("/v1/runs/run-b/reports", b"", _bearer(AG_BOUND)),  # 422: empty
    ("/v1/runs/run-b/reports", b'{"job":"job-a","step_first":5,"step_last":4,"time":1.0}', _bearer(AG_BOUND)),  # 422: order
    ("/v1/runs/run-b/reports", b'{"job":"job-a","step_first":1,"step_last":1,"time":"NaN"}', _bearer(AG_BOUND)),  # 422: time
    ("/v1/runs/run-b/reports", b'{"job":"job-a","step_first":1,"step_last":1,"time":1.0,"extra":1}', _bearer(AG_BOUND)),  # 422: extra
    (f"/v1/runs/{LONG_RUN}/reports", _report(4), _bearer(AG_BOUND)),  # 422: run name too long (the route's check)
    ("/v1/runs/run-b/reports", _report(5, {"trainguard_loss": 1.5}, step_time_s=[0.5, 0.5, 0.5, 0.5]), _bearer(AG_BOUND)),
    ("/v1/runs/run-a/reports", _report(6, {"trainguard_loss": "-Infinity"}), _bearer(AG)),
]


def _rejected(c: TestClient) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(c.get("/metrics", headers=_bearer(OP_READ)).text):
        for s in fam.samples:
            if s.name in ("trainguard_controller_reports_rejected_total", "trainguard_controller_reports_total"):
                out[s.name + str(sorted(s.labels.items()))] = s.value
    return out


def test_fast_path_answers_exactly_like_the_route(tmp_path: Path) -> None:
    answers: dict[bool, list[tuple[int, bytes, str | None, str | None]]] = {}
    counters: dict[bool, dict[str, float]] = {}
    for fast in (True, False):
        with _client(tmp_path / f"{fast}.db", fast=fast) as c:
            answers[fast] = []
            for path, body, headers in CASES:
                r = c.post(path, content=body, headers={"content-type": "application/json", **headers})
                answers[fast].append((r.status_code, r.content, r.headers.get("content-type"), r.headers.get("www-authenticate")))
            counters[fast] = _rejected(c)
            status = c.get("/v1/runs/run-a", headers=_bearer(OP_READ)).json()
            if fast:
                # What the fast path stored is what was sent, NaN/-Inf included.
                assert status["reports"] == 4 and status["last_values"] == {"trainguard_loss": "-Infinity"}
                assert [a["rule"] for a in status["firing_alerts"]] == ["grad_norm_high", "loss_nonfinite"]
    for case, fast_answer, route_answer in zip(CASES, answers[True], answers[False]):
        assert fast_answer == route_answer, (case[0], case[1][:80], fast_answer, route_answer)
    statuses = [a[0] for a in answers[True]]
    assert statuses == [200, 200, 200, 401, 401, 403, 403, 403, 403, 404, 409, 422, 422, 422, 422, 422, 422, 422, 200, 200]
    assert answers[True][3][3] == "Bearer"  # 401 names the scheme
    assert json.loads(answers[True][1][1])["alerts"] == ["grad_norm_high"]
    assert json.loads(answers[True][2][1])["desired"]["paused"] is True
    assert json.loads(answers[True][10][1]) == {"detail": "run 'run-b' belongs to job 'job-a', the report says 'other'"}
    assert json.loads(answers[True][12][1])["errors"][0]["type"] == "json_invalid"
    assert counters[True] == counters[False]
    # Six refusals of the body (length + five that do not validate), each counted once.
    assert counters[True]["trainguard_controller_reports_rejected_total[('reason', 'invalid')]"] == 6
    assert counters[True]["trainguard_controller_reports_total[]"] == 5


@pytest.mark.parametrize("chunks", [[b""], [b"{\"job\":\"job-a\",", b"\"step_first\":1,\"step_last\":1,", b"\"time\":1.0}"]])
def test_fast_path_reads_chunked_bodies(tmp_path: Path, chunks: list[bytes]) -> None:
    with _client(tmp_path / "c.db", fast=True) as c:
        r = c.post("/v1/runs/run-a/reports", content=iter(chunks), headers={"content-type": "application/json", **_bearer(AG)})
        assert r.status_code == (422 if chunks == [b""] else 200), r.text


def test_other_routes_under_the_prefix_pass_through(tmp_path: Path) -> None:
    with _client(tmp_path / "p.db", fast=True) as c:
        # Not a report post: GET on the report path, a nested path, the register route.
        assert c.get("/v1/runs/run-a/reports", headers=_bearer(AG)).status_code == 405
        assert c.post("/v1/runs/run-a/x/reports", content=_report(1), headers=_bearer(AG)).status_code == 404
        assert c.post("/v1/runs/run-a/acks", json={"generation": 0, "step": 1}, headers=_bearer(AG)).status_code == 200
        assert "/v1/runs/{run}/reports" in c.get("/openapi.json").json()["paths"]


def test_good_reports_do_not_reach_the_route(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def unreachable(self: Request) -> bytes:
        raise AssertionError("the FastAPI route read a report the fast path should have answered")

    with _client(tmp_path / "u.db", fast=True) as c:
        monkeypatch.setattr(Request, "body", unreachable)  # after registering: only a report route would read now
        r = c.post("/v1/runs/run-a/reports", content=_report(1, {"trainguard_loss": 1.0}), headers=_bearer(AG))
        assert r.status_code == 200 and json.loads(r.content)["alerts"] == []


def _stored(db: Path) -> list[tuple[int, int]]:
    import sqlite3

    with contextlib.closing(sqlite3.connect(db)) as c:
        return c.execute("SELECT step_first, step_last FROM reports ORDER BY seq").fetchall()


def test_a_report_sent_again_is_stored_and_evaluated_once(tmp_path: Path) -> None:
    """The agent sends a report again when its answer was lost (the controller it went to died
    after committing it): the same report (step range, send time, values; NaN included) is
    answered with the desired state, not stored or evaluated twice — also after a restart — while
    another report of the same steps (other values or per-rank vectors) and a re-registered run
    (a restarted job) are stored, and a malformed one is refused as before."""
    settings = Settings(db=tmp_path / "tg.db", tick_s=60)
    nan = {"job": "job-a", "step_first": 11, "step_last": 20, "time": 1.0, "values": {"trainguard_loss": "NaN"}}
    with TestClient(create_app(settings)) as c:
        register(c, world_size=1)
        first = c.post("/v1/runs/run-1/reports", json=nan)
        again = c.post("/v1/runs/run-1/reports", json=nan)
        assert first.status_code == again.status_code == 200
        assert first.json()["alerts"] == ["loss_nonfinite"] and again.json() == {**first.json(), "alerts": []}
        assert c.get("/v1/runs/run-1").json()["reports"] == 1
        assert c.post("/v1/runs/run-1/reports", json={**nan, "ranks": {"loss": [1.0, 2.0]}}).status_code == 422  # checked first
        with_ranks = {**nan, "step_first": 21, "step_last": 21, "ranks": {"loss": ["NaN"], "verify_mismatch": ["NaN"]}}
        assert c.post("/v1/runs/run-1/reports", json=with_ranks).status_code == 200
        assert c.post("/v1/runs/run-1/reports", json=with_ranks).status_code == 200  # NaN vectors: the same report
        assert c.post("/v1/runs/run-1/reports", json={**with_ranks, "ranks": {"loss": [1.0]}}).status_code == 200  # not
        assert c.get("/v1/runs/run-1").json()["reports"] == 3
        other = {**nan, "values": {"trainguard_loss": "NaN", "trainguard_grad_norm": 1.0}}  # not the same report
        assert c.post("/v1/runs/run-1/reports", json=other).status_code == 200
        assert c.post("/v1/runs/run-1/reports", json=other).status_code == 200  # ... sent again
        assert c.get("/v1/runs/run-1").json()["reports"] == 4
        metrics = c.get("/metrics").text
        assert "trainguard_controller_reports_resent_total 3.0" in metrics
        assert 'trainguard_controller_alerts_total{rule="loss_nonfinite",severity="critical"} 1.0' in metrics
    with TestClient(create_app(settings)) as c:  # restarted: the last stored range is known again
        assert c.post("/v1/runs/run-1/reports", json=other).json()["alerts"] == []
        assert c.get("/v1/runs/run-1").json()["reports"] == 4
        register(c, world_size=1)  # the job restarted from a checkpoint: it reports those steps anew
        assert c.post("/v1/runs/run-1/reports", json={**nan, "values": {"trainguard_loss": 2.0}}).status_code == 200
    assert _stored(tmp_path / "tg.db") == [(11, 20), (21, 21), (21, 21), (11, 20), (11, 20)]
