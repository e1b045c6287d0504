"""End to end with a real ``trainguard serve`` and the agent in this process:

- ``POST /v1/runs/{run}/rollback`` rolls the run back to the newest good snapshot (the weights
  equal those recorded at that step), and is refused (409, with the reason) while the run has no
  good snapshot; ``trainguard incidents`` / ``GET .../incidents`` list the snapshots.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from torch import nn

import trainer_agent as ta
from tests.control.procs import ControllerProcess, module_controller, until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    yield from module_controller(tmp_path_factory)


def _step(model, opt, sched, agent, g) -> float:
    x = torch.randn(32, 8, generator=g)
    loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    if sched is not None:
        sched.step()
    agent.end_step(loss.detach())
    return float(loss.detach())


def test_operator_rollback_goes_to_the_newest_good_snapshot(controller: ControllerProcess) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = "rb-e2e"
    agent = ta.attach(model, opt, job="rb", run=run, controller=controller.url,
                      config=ta.AgentConfig(metrics_port=None, report_every=5, snapshot_every=10, snapshot_keep=3))
    g = torch.Generator().manual_seed(1)
    try:
        for _ in range(3):
            _step(model, opt, None, agent, g)
        r = httpx.post(f"{controller.url}/v1/runs/{run}/rollback", json={"reason": "too early"}, timeout=10)
        assert r.status_code == 409 and "rollback refused" in r.json()["detail"]
        recorded = {}
        for step in range(4, 41):
            _step(model, opt, None, agent, g)
            if step % 10 == 0:
                recorded[step] = [p.detach().clone() for p in model.parameters()]
        assert until(lambda: controller.run_detail(run)["last_step"] == 40, 10.0)
        inc = httpx.get(f"{controller.url}/v1/runs/{run}/incidents", timeout=10).json()
        # The report of a step names the snapshot of that step. Three kept, spaced out (40, then the
        # multiple of 20 below it, then the newest of the rest); a snapshot is good after 2 healthy
        # reports: 20 (reports 25, 30) and 30 (35, 40), not yet 40.
        assert inc["snapshots"] == [{"step": 20, "good": True}, {"step": 30, "good": True}, {"step": 40, "good": False}]
        assert controller.command(run, "rollback")["desired"]["rollback_step"] == 30
        for _ in range(200):
            _step(model, opt, None, agent, g)
            if any(h.restored_step is not None for h in agent.control.history):
                break
        applied = [h for h in agent.control.history if h.rollback_seq == 1]
        assert applied and applied[0].restored_step == 30
        for a, b in zip(recorded[30], model.parameters()):
            assert torch.equal(a, b.detach())
    finally:
        agent.close(5.0)


def test_warm_restarts_are_left_alone(controller: ControllerProcess) -> None:
    # A 20-step linear warm-up, then cosine with warm restarts every 60 steps (each restart
    # multiplies the LR by ~200 in one step), a report every step: the built-in rules open no
    # incident and lr_scale stays 1.0 at every step.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    S = torch.optim.lr_scheduler
    sched = S.SequentialLR(opt, [S.LinearLR(opt, start_factor=0.05, total_iters=20),
                                 S.CosineAnnealingWarmRestarts(opt, T_0=60, eta_min=1e-5)], milestones=[20])
    run = "warm-restarts-e2e"
    agent = ta.attach(model, opt, job="sched", run=run, controller=controller.url, lr_scheduler=sched,
                      config=ta.AgentConfig(metrics_port=None, report_every=1, snapshot_every=20))
    g = torch.Generator().manual_seed(1)
    lrs, scales = [], []
    try:
        for _ in range(200):
            lrs.append(opt.param_groups[0]["lr"])
            _step(model, opt, sched, agent, g)
            scales.append(agent.control.lr_scale)
        assert until(lambda: controller.run_detail(run)["last_step"] == 200, 20.0)
        assert sum(1 for a, b in zip(lrs, lrs[1:]) if b > 20 * a) == 2  # the restarts at steps 80 and 140
        assert scales == [1.0] * 200
        assert agent.control.skip.skipped == 0 and not list(agent.control.history)
        assert httpx.get(f"{controller.url}/v1/runs/{run}/incidents", timeout=10).json()["incidents"] == []
    finally:
        agent.close(5.0)
