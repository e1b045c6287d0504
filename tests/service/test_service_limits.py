"""Limits on what one client may make the controller hold: metric names per run (also after a
restart), runs in all and per agent token, ranks per run. Beyond them: a 4xx that says which
limit, and a counter by reason; what is held stays bounded."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from fastapi.testclient import TestClient

from tests.service.conftest import register
from trainguard.service.app import create_app
from trainguard.service.config import Settings
from trainguard.service.limits import BodyTooLarge, read_body


def _counter(c: TestClient, name: str, reason: str) -> float:
    m = re.search(rf'^{name}{{reason="{reason}"}} (\S+)$', c.get("/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def _report(step: int, names: range) -> dict:
    return {"job": "job-a", "step_first": step, "step_last": step, "time": float(step),
            "values": {f"m_{i}": float(i) for i in names}}


def test_metric_names_per_run_are_bounded_and_the_bound_survives_a_restart(app_factory, tmp_path) -> None:
    with app_factory(max_series_per_run=64) as c:
        register(c, world_size=1)
        register(c, run="run-2", world_size=1)
        ctl = c.app.state.controller
        assert c.post("/v1/runs/run-1/reports", json=_report(1, range(0, 60))).status_code == 200
        step = 2
        for start in range(60, 60 + 4096 * 5, 4096):  # a flood of fresh names
            r = c.post("/v1/runs/run-1/reports", json=_report(step, range(start, start + 4096)))
            assert r.status_code == 422 and "TRAINGUARD_MAX_SERIES_PER_RUN" in r.json()["detail"]
            step += 1
        window = ctl.runs["run-1"].window
        assert len(window.columns) == 60 and window._values.shape[1] <= 2 * 64
        assert _counter(c, "trainguard_controller_reports_rejected_total", "series_limit") == 5
        # up to the limit is fine; the known names always are; another run is unaffected
        assert c.post("/v1/runs/run-1/reports", json=_report(step, range(0, 64))).status_code == 200
        assert c.post("/v1/runs/run-1/reports", json=_report(step + 1, range(0, 65))).status_code == 422
        assert c.post("/v1/runs/run-2/reports", json=_report(1, range(1000, 1064))).status_code == 200
    # a database holding more names than the limit (written under a higher one) loads bounded
    with app_factory(max_series_per_run=1024) as c:
        assert c.post("/v1/runs/run-1/reports", json=_report(100, range(500, 1400))).status_code == 200
    app = create_app(Settings(db=tmp_path / "tg.db", max_series_per_run=64))
    with TestClient(app):
        assert len(app.state.controller.runs["run-1"].window.columns) == 64


def test_runs_in_all_and_per_token_are_bounded(app_factory) -> None:
    with app_factory(max_runs=3) as c:
        for i in range(3):
            register(c, run=f"run-{i}", world_size=1)
        r = c.post("/v1/runs", json={"job": "job-a", "run": "run-9", "world_size": 1, "ranks": []})
        assert r.status_code == 429 and "TRAINGUARD_MAX_RUNS" in r.json()["detail"]
        assert len(c.app.state.controller.runs) == 3
        register(c, run="run-0", world_size=1)  # re-registering a held run is always allowed
        assert _counter(c, "trainguard_controller_registrations_rejected_total", "runs_limit") == 1
    with app_factory(max_runs_per_token=2) as c:  # (no tokens: every caller is the anonymous one)
        register(c, run="a-1", world_size=1)
        register(c, run="a-2", world_size=1)
        r = c.post("/v1/runs", json={"job": "job-a", "run": "a-3", "world_size": 1, "ranks": []})
        assert r.status_code == 429 and "TRAINGUARD_MAX_RUNS_PER_TOKEN" in r.json()["detail"]


def test_ranks_per_run_are_bounded(app_factory) -> None:
    with app_factory(max_world_size=8) as c:
        r = c.post("/v1/runs", json={"job": "job-a", "run": "big", "world_size": 9, "ranks": []})
        assert r.status_code == 422 and "TRAINGUARD_MAX_WORLD_SIZE" in r.json()["detail"]
        register(c, run="ok", world_size=8)
        assert "big" not in c.app.state.controller.runs
        assert _counter(c, "trainguard_controller_registrations_rejected_total", "world_size_limit") == 1


def test_a_run_of_the_largest_world_size_registers_and_reports_and_other_bodies_keep_their_limit(app_factory) -> None:
    """The registration and report body limits follow from TRAINGUARD_MAX_WORLD_SIZE: a run of
    the largest world size registers (every rank with the longest host name) and its largest
    report (every per-rank vector full of the longest numbers, every job-level metric, the most
    desync layers) is taken, though both are larger than TRAINGUARD_MAX_BODY_BYTES; every other
    body keeps that limit."""
    from trainguard.protocol.catalog import BY_NAME
    from trainguard.protocol.wire import (
        MAX_DESYNC_LAYERS, DesyncLayer, RankEndpoint, RankValues, Report, RunRegistration, dumps,
    )
    from trainguard.service.limits import registration_body_bytes, report_body_bytes

    settings = Settings()
    world, longest = settings.max_world_size, -2.2250738585072014e-308  # the longest float64 in JSON
    assert world == 32_768
    report = Report(
        job="job-a", step_first=1, step_last=1, time=1.0,
        values={name: longest for name, m in BY_NAME.items() if not m.labels},
        ranks=RankValues(**{field: [longest] * world for field in RankValues.model_fields}),
        desync=[DesyncLayer(kind="grad", layer=f"{i:03d}" + "l" * 509, rel_diff=-longest, ranks=list(range(64)))
                for i in range(MAX_DESYNC_LAYERS)])
    body = json.dumps(report.model_dump(), separators=(",", ":")).encode()  # an older agent's JSON lists: the largest
    assert settings.max_body_bytes < len(body) <= report_body_bytes(world)
    assert len(dumps(report.ranks)) < 1024  # this agent's: each vector one value, packed
    host = ".".join(["h" * 63] * 3 + ["h" * 61])  # the longest host name (253 characters)
    registration = RunRegistration(job="job-a", run="big", world_size=world, agent_version="v" * 64, ranks=[
        RankEndpoint(rank=r, local_rank=r % 8, host=host, port=65535) for r in range(world)])
    reg_body = dumps(registration)
    assert settings.max_body_bytes < len(reg_body) <= registration_body_bytes(world)
    with app_factory() as c:
        r = c.post("/v1/runs", content=reg_body, headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text[:300]
        r = c.post("/v1/runs/big/reports", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text[:300]
        assert c.get("/v1/runs/big").json()["last_step"] == 1
        over = report_body_bytes(world) + 1
        r = c.post("/v1/runs/big/reports", content=b" " * over, headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert r.json()["detail"] == (f"request body of {over} bytes exceeds the limit of {over - 1} (the largest report of "
                                      "run 'big' of 32768 ranks)")
        r = c.put("/v1/rules", content=b"#" * (settings.max_body_bytes + 1))
        assert r.status_code == 413 and "TRAINGUARD_MAX_BODY_BYTES" in r.json()["detail"]


def _receiver(*messages: dict) -> tuple[object, list[dict]]:
    """An ASGI ``receive`` over ``messages``, and the list of those it handed out."""
    given: list[dict] = []

    async def receive() -> dict:
        given.append(messages[len(given)])
        return given[-1]

    return receive, given


def test_the_body_reader_joins_chunks_stops_past_its_limit_and_sees_a_disconnect() -> None:
    chunks = ({"type": "http.request", "body": b"abc", "more_body": True},
              {"type": "http.request", "body": b"defg", "more_body": True},
              {"type": "http.request", "body": b"h", "more_body": False})
    receive, given = _receiver(*chunks)
    assert asyncio.run(read_body(receive)) == b"abcdefgh" and len(given) == 3
    receive, given = _receiver(*chunks)
    assert asyncio.run(read_body(receive, max_bytes=8)) == b"abcdefgh"
    receive, given = _receiver(*chunks)
    with pytest.raises(BodyTooLarge):
        asyncio.run(read_body(receive, max_bytes=6))
    assert len(given) == 2  # the 7th byte arrived: nothing more is read
    receive, given = _receiver(chunks[0], {"type": "http.disconnect"})
    assert asyncio.run(read_body(receive)) is None


def test_a_reports_limit_follows_its_own_runs_world_size(app_factory) -> None:
    """A run of a few ranks is refused a report body larger than its world size allows (413 before
    anything parses it), though a run of TRAINGUARD_MAX_WORLD_SIZE ranks may send one that large; a
    run not registered keeps the largest limit, so its agent hears 404 and registers."""
    from trainguard.service.limits import report_body_bytes

    with app_factory(max_body_bytes=1024) as c:
        register(c, run="small", world_size=2)
        assert report_body_bytes(2) < 200_000 < report_body_bytes(32_768)
        body = b'{"job":"job-a"' + b" " * 200_000 + b"}"
        r = c.post("/v1/runs/small/reports", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert r.json()["detail"] == (f"request body of {len(body)} bytes exceeds the limit of {report_body_bytes(2)} "
                                      "(the largest report of run 'small' of 2 ranks)")
        assert c.get("/v1/runs/small").json()["reports"] == 0
        r = c.post("/v1/runs/other/reports", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 422  # (parsed: the body is no report; a report would be 404, not registered)
        register(c, run="small", world_size=64)  # registered again, larger: its limit grows with it
        r = c.post("/v1/runs/small/reports", content=b" " * report_body_bytes(64), headers={"content-type": "application/json"})
        assert r.status_code == 422
