"""End to end with a real ``trainguard serve`` and the agent in this process:

- ``POST /v1/runs/{run}/rollback`` rolls the run back to the newest good snapshot (the weights
  equal those recorded at that step), and is refused (409, with the reason) while the run has no
  good snapshot; ``trainguard incidents`` / ``GET .../incidents`` list the snapshots.
- The user's LR schedule jumps x40 and stays: the default rules' adaptive LR brings lr_scale to
  about 1/40 from the measured update ratio, without a human.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from torch import nn

import trainer_agent as ta
from tests.control.procs import ControllerProcess, until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    ctl = ControllerProcess(tmp_path_factory.mktemp("ctl") / "trainguard.db").start()
    yield ctl
    ctl.kill()


def _step(model, opt, sched, agent, g) -> float:
    x = torch.randn(32, 8, generator=g)
    loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    if sched is not None:
        sched.step()
    agent.end_step(loss.detach())
    return float(loss)


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
        # 40 was first reported at step 40: no healthy report after it yet, so not good; 30 is.
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


def test_persistent_lr_blowup_is_scaled_back_from_the_measurement(controller: ControllerProcess) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 40.0 if s >= 300 else 1.0)
    run = "lr-e2e"
    agent = ta.attach(model, opt, job="lr", run=run, controller=controller.url, lr_scheduler=sched,
                      config=ta.AgentConfig(metrics_port=None, report_every=10))
    g = torch.Generator().manual_seed(2)
    try:
        for _ in range(500):
            _step(model, opt, sched, agent, g)
            if agent.control.lr_scale < 1.0:
                break
        first = next(h for h in agent.control.history if h.lr_scale < 1.0)
        assert 300 < first.step <= 330  # acted on within the reports after the onset
        assert 1 / 60 < first.lr_scale < 1 / 25  # from the measurement, not a halving
    finally:
        agent.close(5.0)
