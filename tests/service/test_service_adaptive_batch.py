"""The adaptive batch size through the real controller: the built-in ``batch_grow_low_variance``
and ``batch_shrink_high_variance`` rules (shipped off) turned on, reports of a run that opted in
to the ``accumulation`` command (``accumulation_steps`` at registration) grow its accumulation
steps 1.5x while the gradient variance is low and shrink them 1.2x while it is high, with the
action's LR rule, once per cooldown; a run that did not opt in is left alone and the alert says
why; during an open incident the batch is left alone."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from trainguard.service.rules import default_rules_text, load_rules

GROW, SHRINK = "batch_grow_low_variance", "batch_shrink_high_variance"


def _shipped() -> dict:
    return {r["name"]: r for r in yaml.safe_load(default_rules_text())["rules"]}


def _rules_file(tmp_path: Path) -> Path:
    raw = yaml.safe_load(default_rules_text())
    for r in raw["rules"]:
        if r["name"] in (GROW, SHRINK):
            r["enabled"] = True
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _register(c, run: str, config: dict) -> None:  # type: ignore[no-untyped-def]
    body = {"job": "job-a", "run": run, "world_size": 1, "agent_version": "test", "config": config,
            "ranks": [{"rank": 0, "local_rank": 0, "host": "127.0.0.1", "port": 9100}]}
    assert c.post("/v1/runs", json=body).status_code == 200


def _grown(steps: int, factor: float) -> int:
    """The fold's rule, computed here: x factor rounded half up, at least one step, within 1-64."""
    new = math.floor(steps * factor + 0.5)
    new = new if new != steps else steps + (1 if factor > 1 else -1)
    return min(max(new, 1), 64)


class _Run:
    def __init__(self, c, run: str, now: list[float]) -> None:  # type: ignore[no-untyped-def]
        self.c, self.run, self.now, self.step = c, run, now, 0

    def report(self, variance: float, n: int = 1, *, snapshot: bool = False, **extra: float) -> dict:
        for _ in range(n):
            self.step += 10
            values = {"trainguard_loss": 2.0, "trainguard_grad_norm_max": 1.0, "trainguard_grad_variance": variance, **extra}
            if snapshot:  # the agent took an in-memory snapshot at this step
                values["trainguard_snapshot_step"] = float(self.step)
            body = {"job": "job-a", "step_first": self.step - 9, "step_last": self.step, "time": self.now[0], "values": values}
            r = self.c.post(f"/v1/runs/{self.run}/reports", json=body)
            assert r.status_code == 200, r.text
            self.now[0] += 10.0
        return self.c.get(f"/v1/runs/{self.run}/desired").json()

    def alerts(self, rule: str) -> list[dict]:
        return [a for a in self.c.get("/v1/alerts", params={"run": self.run}).json() if a["rule"] == rule]


def test_the_adaptive_batch_rules_ship_off_and_a_healthy_run_keeps_its_batch(app_factory) -> None:  # type: ignore[no-untyped-def]
    shipped = _shipped()
    assert shipped[GROW]["enabled"] is False and shipped[SHRINK]["enabled"] is False
    assert {r.name for r in load_rules(default_rules_text()).base} & {GROW, SHRINK} == set()
    now = [1_000.0]
    with app_factory(clock=lambda: now[0]) as c:
        _register(c, "run-1", {"accumulation_steps": 4})
        desired = _Run(c, "run-1", now).report(0.01, n=8)  # low variance: the built-in rules do nothing
        assert desired["generation"] == 0 and desired["accumulation_steps"] == 0


def test_low_variance_grows_and_high_variance_shrinks_the_steps_once_per_cooldown(app_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    shipped = _shipped()
    grow = shipped[GROW]["actions"][0]["factor"]
    shrink = shipped[SHRINK]["actions"][0]["factor"]
    cooldown = shipped[GROW]["cooldown_s"]
    assert (grow, shrink, shipped[GROW]["value"], shipped[SHRINK]["value"]) == (1.5, 0.8333, 0.1, 1.0)
    now = [1_000.0]
    with app_factory(clock=lambda: now[0], rules=_rules_file(tmp_path)) as c:
        _register(c, "run-1", {"accumulation_steps": 4})
        run = _Run(c, "run-1", now)
        assert run.report(0.05, n=4)["generation"] == 0  # 4 reports below 0.1: not yet (5 in a row)
        desired = run.report(0.05, snapshot=True)
        assert (desired["accumulation_steps"], desired["accumulation_lr_rule"], desired["generation"]) == (6, "sqrt", 1)
        assert desired["reason"].startswith(f"{GROW}: ")
        assert "accumulation steps 4 -> 6 (x1.5; the run's own 4, LR rule sqrt)" in desired["reason"]
        # Still low: the rule stays firing and does not act again; its reports are healthy for the
        # recovery ladder (the snapshot taken when it fired is confirmed good, not tainted).
        assert run.report(0.05, n=5)["generation"] == 1
        assert c.get("/v1/runs/run-1/incidents").json()["snapshots"] == [{"step": 50, "good": True}]
        # Back in the band, then low again within the cooldown: suppressed.
        run.report(0.5)
        assert run.report(0.05, n=5)["accumulation_steps"] == 6
        assert len(run.alerts(GROW)) == 1
        # After the cooldown it grows from the steps in force: 6 x 1.5 = 9.
        run.report(0.5)
        now[0] += cooldown
        desired = run.report(0.05, n=5)
        assert (desired["accumulation_steps"], desired["generation"]) == (_grown(6, grow), 2) == (9, 2)
        # High variance: shrinks 1.2x (x 0.8333, rounded half up) from 9.
        desired = run.report(2.0, n=5)
        assert (desired["accumulation_steps"], desired["accumulation_lr_rule"]) == (_grown(9, shrink), "sqrt") == (7, "sqrt")
        assert desired["reason"].startswith(f"{SHRINK}: ")
        assert c.get("/v1/runs/run-1/incidents").json()["incidents"] == []
        actions = c.get("/metrics").text
        assert 'trainguard_controller_actions_total{action="accumulation",source="rule"} 3.0' in actions


def test_a_run_that_did_not_opt_in_keeps_its_batch_and_the_alert_says_why(app_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    now = [1_000.0]
    with app_factory(clock=lambda: now[0], rules=_rules_file(tmp_path)) as c:
        _register(c, "plain", {})
        run = _Run(c, "plain", now)
        assert run.report(0.05, n=5)["generation"] == 0
        (alert,) = run.alerts(GROW)
        assert alert["summary"].endswith(
            " — no accumulation change: the run did not opt in (attach the agent with accumulation_steps=N)")


def test_the_batch_is_left_alone_while_an_incident_is_open(app_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = _rules_file(tmp_path)
    raw = yaml.safe_load(path.read_text())
    raw["jobs"] = {"job-a": [{"name": GROW, "for_reports": 1}]}  # fires on the first low report
    path.write_text(yaml.safe_dump(raw))
    now = [1_000.0]
    with app_factory(clock=lambda: now[0], rules=path) as c:
        _register(c, "run-1", {"accumulation_steps": 4})
        run = _Run(c, "run-1", now)
        # The gradient norm rising above 1e3 cuts the LR and opens an incident; the variance then drops.
        assert run.report(0.5, trainguard_grad_norm_max=10.0)["lr_scale"] == 1.0
        assert run.report(0.5, trainguard_grad_norm_max=3000.0)["lr_scale"] == 0.5
        (incident,) = c.get("/v1/runs/run-1/incidents").json()["incidents"]
        assert incident["outcome"] == "open"
        desired = run.report(0.05, trainguard_grad_norm_max=3000.0)
        assert desired["accumulation_steps"] == 0 and desired["generation"] == 1
        (alert,) = run.alerts(GROW)
        assert alert["summary"].endswith(f" — accumulation refused: incident {incident['id']} is open")


def _shards_in_turn_run(c, run: str, now: list[float], steps: int) -> list[tuple[int, dict]]:  # type: ignore[no-untyped-def]
    """Train a small regression for real, its batches from two shards of different difficulty in
    turn (4 steps each: the loss swings with a period of 8 reports), with the agent attached
    (``report_every`` 1, 2 micro-batches per step of its own) and every report sent to the
    controller; each step takes as many micro-batches as the controller's desired state says.
    Returns (the report's step, the desired state after it)."""
    import torch
    from torch import nn

    import trainer_agent as ta

    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    x = torch.randn(4096, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g)
    noise = 2.0 * torch.randn(4096, 1, generator=g)  # the hard shard's targets are noisy
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    agent = ta.attach(model, opt, job="job-a", run=run, config=ta.AgentConfig(metrics_port=None, report_every=1),
                      accumulation_steps=2)
    history, micro = [], 2
    try:
        for k in range(steps):
            hard = (k // 4) % 2 == 1
            total = 0.0
            for _ in range(micro):
                idx = torch.randint(0, 4096, (32,), generator=g)
                loss = nn.functional.mse_loss(model(x[idx]), y[idx] + (noise[idx] if hard else 0.0)) / micro
                loss.backward()
                total += float(loss.detach())
            opt.step()
            opt.zero_grad()
            agent.end_step(torch.tensor(total), tokens=32 * micro)
            values = {n: v for n, v in agent.latest().items() if "{" not in n}
            body = {"job": "job-a", "step_first": k + 1, "step_last": k + 1, "time": now[0], "values": values}
            assert c.post(f"/v1/runs/{run}/reports", json=body).status_code == 200
            now[0] += 10.0
            desired = c.get(f"/v1/runs/{run}/desired").json()
            micro = desired["accumulation_steps"] or 2
            history.append((k + 1, desired))
    finally:
        agent.close(1.0)
    return history


def test_the_batch_does_not_grow_while_the_loss_oscillates(app_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A periodically swinging loss is a batch too large (or a periodic data order): growing the
    batch then is the opposite of the remedy. The easy shard's low gradient variance grows the
    batch once before the swing shows; after the cooldown, with loss_oscillation firing, the next
    grow is refused and the alert says why."""
    path = _rules_file(tmp_path)
    raw = yaml.safe_load(path.read_text())
    # tr(Sigma) of this model: tens on the easy shard, hundreds on the noisy one (set per job, as the rules' docs say)
    raw["jobs"] = {"job-a": [{"name": GROW, "value": 100.0, "for_reports": 3}, {"name": SHRINK, "enabled": False}]}
    path.write_text(yaml.safe_dump(raw))
    now = [1_000.0]
    with app_factory(clock=lambda: now[0], rules=path) as c:
        _register(c, "osc", {"accumulation_steps": 2})
        history = _shards_in_turn_run(c, "osc", now, 130)
        alerts = [a for a in c.get("/v1/alerts", params={"run": "osc"}).json()]
    grows = sorted((a for a in alerts if a["rule"] == GROW), key=lambda a: a["id"])
    swings = [a for a in alerts if a["rule"] == "loss_oscillation"]
    assert len(swings) == 1 and swings[0]["values"]["period_reports"] == pytest.approx(8.0, rel=0.2)
    assert len(grows) == 2, [(a["step"], a["summary"]) for a in grows]
    first, second = grows
    assert first["starts_at"] < swings[0]["starts_at"] <= second["starts_at"]
    assert "accumulation steps 2 -> 3" in first["summary"] and "refused" not in first["summary"]
    assert second["summary"].endswith(
        " — accumulation refused: the loss oscillates periodically, and a batch too large is its likely cause")
    grown = _grown(2, 1.5)
    assert [d["accumulation_steps"] for _, d in history][-1] == grown  # the grow before the swing showed, only
