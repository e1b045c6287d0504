"""A real ``trainguard serve`` process: SIGKILL and restart lose nothing (reports, desired state,
alerts, audit log, a webhook message that was in flight); the CLI and the SSE stream."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import httpx
import pytest

from trainguard.service.webhooks import verify
from tests.service.conftest import wait_until

pytestmark = pytest.mark.integration

OP, AG = "op-token-restart-1", "agent-token-restart-1"
ENV = {"TRAINGUARD_OPERATOR_TOKENS": OP, "TRAINGUARD_AGENT_TOKENS": f"{AG}:run-r"}
SECRET = "restart-secret-0123456789"


def cli(url: str, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "trainguard.cli", *args], capture_output=True, text=True, timeout=60,
                         env={"TRAINGUARD_URL": url, "TRAINGUARD_TOKEN": OP, "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_sigkill_restart_loses_nothing(tmp_path, serve, receiver_factory):
    db = tmp_path / "tg.db"
    rx = receiver_factory([0, 200])  # the first delivery hangs: the controller dies mid-delivery
    srv = serve(db, ENV)
    op = httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {OP}"}, timeout=10)
    ag = httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {AG}"}, timeout=10)
    assert op.post("/v1/webhooks", json={"url": rx.url, "secret": SECRET, "min_severity": "critical", "send_resolved": False}).status_code == 201
    assert ag.post("/v1/runs", json={"job": "job-r", "run": "run-r", "world_size": 2,
                                     "ranks": [{"rank": r, "local_rank": r, "host": "127.0.0.1", "port": 9200 + r} for r in range(2)]}).status_code == 200
    for step in range(30):
        body = {"job": "job-r", "step_first": step, "step_last": step, "time": float(step),
                "values": {"trainguard_loss": 3.0 - 0.01 * step, "trainguard_grad_norm_max": 2000.0 if step == 20 else 1.0},
                "ranks": {"step_time_s": [0.1, 0.1]}}
        assert ag.post("/v1/runs/run-r/reports", json=body).status_code == 200
    assert json.loads(cli(srv.url, "pause", "run-r", "--reason", "before the crash"))["desired"]["paused"] is True
    nan = {"job": "job-r", "step_first": 30, "step_last": 30, "time": 30.0, "values": {"trainguard_loss": "NaN"}}
    assert ag.post("/v1/runs/run-r/reports", json=nan).json()["alerts"] == ["loss_nonfinite"]
    wait_until(lambda: rx.requests)  # the delivery is in flight (the receiver holds it)
    before_status = op.get("/v1/runs/run-r").json()
    before_events = op.get("/v1/runs/run-r/events").json()
    before_alerts = op.get("/v1/alerts").json()
    srv.kill()

    srv2 = serve(db, ENV)
    op = httpx.Client(base_url=srv2.url, headers={"Authorization": f"Bearer {OP}"}, timeout=10)
    after_status = op.get("/v1/runs/run-r").json()
    for key in ("desired", "desired_generation", "reports", "last_step", "firing", "world_size", "ranks", "last_values"):
        assert after_status[key] == before_status[key], key
    assert after_status["reports"] == 31 and after_status["last_values"]["trainguard_loss"] == "NaN"
    assert op.get("/v1/runs/run-r/events").json() == before_events
    assert op.get("/v1/alerts").json() == before_alerts
    # grad_norm_high and grad_norm_spike halve the LR twice, the CLI pauses; the NaN finds it paused.
    assert [e["generation"] for e in before_events if e["kind"] == "desired"] == [1, 2, 3]
    assert after_status["desired"]["lr_scale"] == 0.25
    # The webhook message that was in flight when the process died is delivered after the restart.
    wait_until(lambda: len(rx.requests) >= 2)
    (h1, b1), (h2, b2) = rx.requests[:2]
    assert b1 == b2 and h1["x-trainguard-delivery"] == h2["x-trainguard-delivery"]
    assert verify(SECRET, int(h2["x-trainguard-timestamp"]), b2, h2["x-trainguard-signature"])
    hook_id = op.get("/v1/webhooks").json()[0]["id"]
    wait_until(lambda: [d["outcome"] for d in op.get(f"/v1/webhooks/{hook_id}/deliveries").json()] == ["delivered"])

    # The restored window holds the 30 reports of history (loss_spike needs 16), and the restored
    # cooldown keeps grad_norm_spike (fired at step 20) quiet.
    ag = httpx.Client(base_url=srv2.url, headers={"Authorization": f"Bearer {AG}"}, timeout=10)
    spike = {"job": "job-r", "step_first": 31, "step_last": 31, "time": 31.0, "values": {"trainguard_loss": 10.0, "trainguard_grad_norm_max": 50.0}}
    assert ag.post("/v1/runs/run-r/reports", json=spike).json()["alerts"] == ["loss_spike"]

    # The CLI, and `events --follow` over Server-Sent Events.
    assert "run-r" in cli(srv2.url, "runs")
    assert json.loads(cli(srv2.url, "status", "run-r"))["run"] == "run-r"
    follow = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "events", "run-r", "--follow", "--json"],
                              stdout=subprocess.PIPE, text=True, env={"TRAINGUARD_URL": srv2.url, "TRAINGUARD_TOKEN": OP, "PATH": "/usr/bin:/bin"})
    lines: list[dict] = []
    reader = threading.Thread(target=lambda: [lines.append(json.loads(line)) for line in follow.stdout], daemon=True)
    reader.start()
    try:
        wait_until(lambda: len(lines) >= len(before_events))
        cli(srv2.url, "resume", "run-r", "--reason", "after the crash")
        resumed = wait_until(lambda: [e for e in lines if e["reason"] == "after the crash"])
        assert resumed[0]["kind"] == "desired" and resumed[0]["data"]["desired"]["paused"] is False
        assert [e["id"] for e in lines] == sorted({e["id"] for e in lines})  # replay then live, no duplicates
    finally:
        follow.kill()
        follow.wait(10)
