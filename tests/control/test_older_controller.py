"""trainer_agent/report/older_controller.py: an agent that names its ranks' nodes registers with a
controller older than the field. Such a controller refuses fields it does not know with a 422
naming them (``extra_forbidden``, in the controller's error format or FastAPI's own): the client
registers again without the node, once, and keeps that registration; another refusal is not
answered so."""

from __future__ import annotations

import json
import logging
import threading

import httpx
import pytest
from pydantic import Field

from tests.control.procs import until
from trainguard.protocol.base import Int, Rank, WireModel
from trainguard.protocol.wire import DesiredState, RankEndpoint, Report, RunRegistration, dumps
from trainguard.service.schemas import validation_summary
from trainer_agent.report.client import ControllerClient
from trainer_agent.report.older_controller import unknown_rank_fields

REG = RunRegistration(job="job-a", run="run-a", world_size=2, ranks=[
    RankEndpoint(rank=r, local_rank=0, host="127.0.0.1", port=9400 + r, node=f"gpu-{r}") for r in (0, 1)])


class _OlderRank(WireModel):  # RankEndpoint before the node: unknown fields refused
    rank: Rank
    local_rank: Rank
    host: str
    port: Int


class _OlderRegistration(WireModel):
    job: str
    run: str
    world_size: Int
    ranks: list[_OlderRank] = []
    agent_version: str = Field(default="", max_length=5)
    config: dict = {}


class OlderController:
    """A MockTransport handler validating registrations as a controller before the node did, and
    answering their refusal in ``style``: this controller's 422 (``errors``) or FastAPI's (``detail``)."""

    def __init__(self, style: str = "controller") -> None:
        self.style = style
        self.registrations: list[dict] = []
        self.reports = 0
        self.lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/runs":
            body = json.loads(request.content)
            with self.lock:
                self.registrations.append(body)
            try:
                _OlderRegistration.model_validate(body)
            except Exception as exc:  # noqa: BLE001 - a pydantic ValidationError
                errors = [{"type": e["type"], "loc": ["body", *e["loc"]], "msg": e["msg"]} for e in exc.errors()]
                answer = ({"detail": validation_summary(errors), "errors": errors} if self.style == "controller"
                          else {"detail": errors})
                return httpx.Response(422, json=answer)
            return httpx.Response(200, json={"job": "job-a", "run": "run-a", "desired": json.loads(dumps(DesiredState()))})
        if request.url.path.endswith("/reports"):
            with self.lock:
                self.reports += 1
            return httpx.Response(200, json={"desired": json.loads(dumps(DesiredState())), "alerts": []})
        return httpx.Response(200, json=json.loads(dumps(DesiredState())))


def _client(handler: OlderController, reg: RunRegistration = REG) -> ControllerClient:
    return ControllerClient("http://older", registration=reg, transport=httpx.MockTransport(handler), request_timeout_s=1.0,
                            long_poll_s=0.2, backoff_initial_s=0.01, backoff_max_s=0.05)


@pytest.mark.parametrize("style", ["controller", "fastapi"])
def test_an_older_controller_gets_the_registration_without_the_node(style: str, caplog: pytest.LogCaptureFixture) -> None:
    older = OlderController(style)
    client = _client(older)
    with caplog.at_level(logging.WARNING, logger="trainer_agent"):
        client.start()
        try:
            assert client.wait_registered(10.0) is not None
            client.submit_report(Report(job="job-a", step_first=1, step_last=1, time=1.0, values={}))
            assert until(lambda: older.reports == 1, 10.0)
        finally:
            client.close(2.0)
    first, second = older.registrations[:2]
    assert [r["node"] for r in first["ranks"]] == ["gpu-0", "gpu-1"]
    assert second == {**first, "ranks": [{k: v for k, v in r.items() if k != "node"} for r in first["ranks"]]}
    assert len(older.registrations) == 2
    assert sum("does not know the registration's node" in r.getMessage() for r in caplog.records) == 1


def test_a_registration_refused_for_another_reason_is_not_sent_without_the_node() -> None:
    older = OlderController()
    bad = REG.model_copy(update={"agent_version": "0.10.0"})  # the older controller refuses it (and the nodes)
    client = _client(older, bad)
    client.start()
    try:
        assert until(lambda: len(older.registrations) >= 3, 10.0)
    finally:
        client.close(1.0)
    assert all("node" in body["ranks"][0] for body in older.registrations)


@pytest.mark.parametrize("status, body, expect", [
    (422, {"errors": [{"type": "extra_forbidden", "loc": ["body", "ranks", 3, "node"]}]}, frozenset({"node"})),
    (422, {"detail": [{"type": "extra_forbidden", "loc": ["body", "ranks", 0, "node"]}]}, frozenset({"node"})),
    (400, {"errors": [{"type": "extra_forbidden", "loc": ["body", "ranks", 0, "node"]}]}, None),
    (422, {"errors": [{"type": "extra_forbidden", "loc": ["body", "ranks", 0, "colour"]}]}, None),  # not optional
    (422, {"errors": [{"type": "extra_forbidden", "loc": ["body", "node"]}]}, None),  # not a rank's
    (422, {"errors": [{"type": "extra_forbidden", "loc": ["body", "ranks", 0, "node"]},
                      {"type": "missing", "loc": ["body", "job"]}]}, None),  # refused for more than the node
    (422, {"detail": "the request does not validate"}, None),
    (422, [], None),
])
def test_only_a_refusal_of_the_optional_rank_fields_alone_is_recognised(status: int, body, expect) -> None:
    assert unknown_rank_fields(status, json.dumps(body).encode()) == expect
    assert unknown_rank_fields(status, b"\xff not json") is None
