"""A real ``trainguard serve`` process: SIGKILL and restart lose nothing (reports, desired state,
alerts, audit log, a webhook message that was in flight); the CLI and the SSE stream. A healthy
two-rank gloo job outlives a controller down for longer than the absence limit: no alert, no
action, the command issued before the kill applied once on both ranks at the same step. A job
that dies and restarts from an earlier checkpoint is judged on its new course: no false alert."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from trainguard.service.webhooks import verify
from tests.control.procs import ROOT, ControllerProcess, Ranks, until
from tests.service.conftest import rule_evaluations, wait_until
from tests.tools.faultproxy import FaultProxy

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


SILENT_S = 7.0  # run_silent's limit here: longer than the agent's longest retry wait (5 s) after an outage


def _evaluations(url: str) -> float:
    """The controller's rule evaluations so far (reports' and the absence ticker's)."""
    return rule_evaluations(httpx.get(f"{url}/metrics", timeout=10).text)


@pytest.mark.distributed
def test_a_healthy_job_outlives_a_controller_down_longer_than_the_absence_limit(tmp_path: Path) -> None:
    rules = yaml.safe_load((ROOT / "service" / "default_rules.yaml").read_text())
    (silent,) = [r for r in rules["rules"] if r["name"] == "run_silent"]
    silent["seconds"] = SILENT_S
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    ctl = ControllerProcess(tmp_path / "tg.db", rules=tmp_path / "rules.yaml", env={"TRAINGUARD_TICK_S": "0.1"}).start()
    run = "outage-0"
    try:
        with FaultProxy(ctl.port) as proxy:
            ranks = Ranks(2, {"scenario": "trials", "controller": proxy.url, "prefix": "outage", "trials": 1,
                              "max_steps": 100_000, "jitter_s": 0.01}, tmp_path)
            try:
                assert until(lambda: ranks.exited() or (ctl.run_detail(run) or {}).get("reports", 0) >= 10, 120, 0.05)
                gen = ctl.command(run, "checkpoint")["desired"]["generation"]
                ctl.kill()  # right after the command: the ranks may not have seen it yet
                proxy.set_mode("down")
                time.sleep(SILENT_S + 1.0)  # the outage itself (not a wait for an event): longer than the limit
                ctl.start()
                proxy.set_upstream(ctl.port)
                # The job cannot reach the restarted controller until its ticker has checked the run.
                ticks = _evaluations(ctl.url)
                assert until(lambda: _evaluations(ctl.url) >= ticks + 2, 60, 0.02)
                assert ctl.run_detail(run)["firing"] == []  # the controller's downtime is no silence of the run
                proxy.set_mode("pass")
                assert until(lambda: ranks.exited() or ctl.run_detail(run)["applied_generation"] == gen, 60, 0.05)
                reports = ctl.run_detail(run)["reports"]
                assert until(lambda: ranks.exited() or ctl.run_detail(run)["reports"] >= reports + 10, 60, 0.05)
                stop = ctl.command(run, "stop")["desired"]["generation"]
                codes = ranks.wait(120)
            finally:
                ranks.kill()
        assert codes == [0, 0], ranks.output()
        logs = [json.loads((tmp_path / f"trials-rank{r}.json").read_text())[0] for r in range(2)]
        # every rank: the checkpoint once, the stop, at the same steps; nothing else applied
        assert [h[:6] for h in logs[0]["history"]] == [h[:6] for h in logs[1]["history"]]
        assert [h[0] for h in logs[0]["history"]] == [gen, stop]
        (ckpt, _), (end, _) = [(h[1], h[4]) for h in logs[0]["history"]]
        assert logs[0]["checkpoints"] == logs[1]["checkpoints"] == [ckpt, end]
        assert len(logs[0]["steps"]) == len(logs[1]["steps"]) == end
        events = httpx.get(f"{ctl.url}/v1/runs/{run}/events", timeout=10).json()
        assert not [e for e in events if e["kind"] == "alert" and e["data"]["rule"] == "run_silent"]
        assert [e["generation"] for e in events if e["kind"] == "desired"] == [gen, stop]  # the operator's only
        assert httpx.get(f"{ctl.url}/v1/runs/{run}/incidents", timeout=10).json()["incidents"] == []
    finally:
        ctl.kill()


@pytest.mark.distributed
def test_a_job_restarted_from_an_earlier_checkpoint_opens_no_incident(tmp_path: Path) -> None:
    ctl = ControllerProcess(tmp_path / "tg.db").start()  # the default rules, recovery included
    run, worker = "resume-0", str(ROOT / "tests" / "control" / "dist_worker.py")
    try:
        first = Ranks(2, {"scenario": "first", "phase": "first", "run": run, "controller": ctl.url, "ckpt_step": 10,
                          "crash_step": 150, "max_steps": 400}, tmp_path, worker=worker)
        assert first.wait(180) == [1, 1], first.output()  # died at step 150
        assert until(lambda: ctl.run_detail(run)["last_step"] == 149, 30, 0.05)  # (the report of step 150 died with it)
        second = Ranks(2, {"scenario": "resume", "phase": "resume", "run": run, "controller": ctl.url,
                           "max_steps": 400}, tmp_path, worker=worker)
        try:
            assert until(lambda: second.exited() or ctl.run_detail(run)["reports"] >= 149 + 40, 120, 0.05)
            gen = ctl.command(run, "checkpoint")["desired"]["generation"]
            assert until(lambda: second.exited() or ctl.run_detail(run)["applied_generation"] == gen, 60, 0.05)
            stop = ctl.command(run, "stop")["desired"]["generation"]
            codes = second.wait(120)
        finally:
            second.kill()
        assert codes == [0, 0], second.output()
        logs = [json.loads((tmp_path / f"resume-rank{r}.json").read_text()) for r in range(2)]
        assert logs[0]["history"] == logs[1]["history"] and [h[0] for h in logs[0]["history"]] == [gen, stop]
        assert logs[0]["checkpoints"] == logs[1]["checkpoints"] == [h[1] for h in logs[0]["history"]]
        assert [r["steps"][0] for r in ctl.reports(run)][148:151] == [149, 11, 12]  # the step went back
        events = httpx.get(f"{ctl.url}/v1/runs/{run}/events", timeout=10).json()
        assert [e["generation"] for e in events if e["kind"] == "desired"] == [gen, stop]  # the operator's only
        # (loss_not_decreasing, info, notify only, reads this small model's plateau, restart or not)
        assert not [e["data"]["rule"] for e in events if e["kind"] == "alert" and e["data"]["rule"] != "loss_not_decreasing"]
        assert httpx.get(f"{ctl.url}/v1/runs/{run}/incidents", timeout=10).json()["incidents"] == []
    finally:
        ctl.kill()


def _resumed(tmp_path: Path, ctl: ControllerProcess, run: str, phase: str, max_steps: int) -> list[list[int]]:
    """Restart the job of ``run`` from its step-10 checkpoint, to ``max_steps`` or a stop: each
    rank's ``on_checkpoint`` steps."""
    worker = str(ROOT / "tests" / "control" / "dist_worker.py")
    ranks = Ranks(2, {"scenario": phase, "phase": "resume", "run": run, "controller": ctl.url, "max_steps": max_steps},
                  tmp_path, worker=worker)
    try:
        assert ranks.wait(120) == [0, 0], ranks.output()
    finally:
        ranks.kill()
    return [json.loads((tmp_path / f"resume-rank{r}.json").read_text())["checkpoints"] for r in range(2)]


@pytest.mark.distributed
def test_a_checkpoint_requested_while_the_job_was_down_is_taken_at_its_restart(tmp_path: Path) -> None:
    ctl = ControllerProcess(tmp_path / "tg.db").start()
    run, worker = "down-0", str(ROOT / "tests" / "control" / "dist_worker.py")
    try:
        first = Ranks(2, {"scenario": "first", "phase": "first", "run": run, "controller": ctl.url, "ckpt_step": 10,
                          "crash_step": -1, "crash_after_ack": True, "max_steps": 100_000}, tmp_path, worker=worker)
        try:
            assert until(lambda: first.exited() or (ctl.run_detail(run) or {}).get("reports", 0) >= 15, 120, 0.05)
            taken = ctl.command(run, "checkpoint")["desired"]["generation"]
            assert first.wait(120) == [1, 1], first.output()  # died once the controller had its ack
        finally:
            first.kill()
        assert ctl.run_detail(run)["applied_generation"] == taken
        # The checkpoint the first job applied is not taken again (its step-10 checkpoint predates it) ...
        assert _resumed(tmp_path, ctl, run, "again", 20) == [[], []]
        # ... one requested while no job ran is taken once, at the first step after the restore, on
        # every rank (not inside attach, before the job restored its checkpoint): queued, as the run
        # finished ...
        ctl.command(run, "checkpoint", on_restart=True)
        assert _resumed(tmp_path, ctl, run, "due", 20) == [[11], [11]]
        # ... and a run stopped while no job ran stops before its first step without a checkpoint.
        ctl.command(run, "stop", on_restart=True)
        assert _resumed(tmp_path, ctl, run, "stopped", 20) == [[], []]
    finally:
        ctl.kill()
