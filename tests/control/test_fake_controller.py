"""The fake controller (kept for fault injection behind the proxy) answers the agent's requests
with the same status codes as the real ``trainguard serve``: what the real API refuses, it
refuses, so a client test cannot pass on a state the real controller never produces."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.control.fake_controller import FakeController
from tests.control.procs import ControllerProcess

pytestmark = pytest.mark.integration

REG = {"job": "job-a", "run": "contract", "world_size": 1, "agent_version": "test",
       "ranks": [{"rank": 0, "local_rank": 0, "host": "127.0.0.1", "port": 9100}]}


def _report(job: str = "job-a", **ranks: list[float]) -> dict:
    return {"job": job, "step_first": 1, "step_last": 1, "time": 1.0, "values": {"trainguard_loss": "NaN"}, "ranks": ranks}


def _exchange(url: str) -> list[tuple[str, int]]:
    """The agent's requests, right and wrong, in order; (what, status) for each."""
    requests = [
        ("report before registering", "POST", "/v1/runs/contract/reports", _report()),
        ("ack before registering", "POST", "/v1/runs/contract/acks", {"generation": 0, "step": 0}),
        ("poll before registering", "GET", "/v1/runs/contract/desired?after=-1", None),
        ("finish before registering", "POST", "/v1/runs/contract/finish", {"step": 1}),
        ("register", "POST", "/v1/runs", REG),
        ("register under another job", "POST", "/v1/runs", {**REG, "job": "job-b"}),
        ("report", "POST", "/v1/runs/contract/reports", _report(loss=[1.0])),
        ("report naming another job", "POST", "/v1/runs/contract/reports", _report("job-b")),
        ("report with 2 ranks in a world of 1", "POST", "/v1/runs/contract/reports", _report(loss=[1.0, 2.0])),
        ("ack of a generation never published", "POST", "/v1/runs/contract/acks", {"generation": 5, "step": 1}),
        ("ack", "POST", "/v1/runs/contract/acks", {"generation": 0, "step": 1}),
        ("poll", "GET", "/v1/runs/contract/desired?after=-1", None),
        ("finish", "POST", "/v1/runs/contract/finish", {"step": 1}),
    ]
    out = []
    with httpx.Client(base_url=url, timeout=10.0) as client:
        for what, method, path, body in requests:
            out.append((what, client.request(method, path, json=body).status_code))
    return out


def test_the_fake_answers_the_agent_as_the_real_controller_does(tmp_path: Path) -> None:
    real = ControllerProcess(tmp_path / "trainguard.db").start()
    try:
        expected = _exchange(real.url)
    finally:
        real.kill()
    with FakeController() as fake:
        got = _exchange(fake.url)
    assert got == expected
    assert dict(expected)["register under another job"] == 409 and dict(expected)["report"] == 200  # not vacuous


def test_the_fake_refuses_operator_commands_the_real_api_refuses() -> None:
    with FakeController() as fake:
        with pytest.raises(ValueError, match="not registered"):
            fake.command("nobody", paused=True)
        httpx.post(fake.url + "/v1/runs", json=REG, timeout=10.0).raise_for_status()
        for bad in (0.0, -1.0, float("nan"), float("inf"), 2e6):
            with pytest.raises(ValueError, match="lr_scale"):
                fake.command("contract", lr_scale=bad)
        assert fake.command("contract", paused=True).generation == 1
        assert fake.command("contract", paused=True).generation == 1  # nothing changed: no new generation
