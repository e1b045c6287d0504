"""A non-finite loss between two reports is the loss the next report carries."""

import math

import pytest
import torch
from prometheus_client import CollectorRegistry

import trainer_agent as ta


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_loss_between_reports_is_reported(bad: float) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = ta.attach(model, opt, job="j", run="r", registry=CollectorRegistry(),
                      config=ta.AgentConfig(report_every=5, metrics_port=None))
    losses = []
    try:
        for step in range(1, 16):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            # The loss the loop hands the agent turns non-finite at step 7 (not a report step:
            # 5, 10, 15 are); the weights stay finite so later losses are finite again.
            seen = loss.detach() * bad if step == 7 else loss.detach()
            losses.append(float(seen))
            agent.end_step(seen)
            if step == 10:
                at_10 = agent.latest()["trainguard_loss"]
        at_15 = agent.latest()["trainguard_loss"]
    finally:
        agent.close(timeout=5.0)
    # step 7's value, not step 10's finite loss
    assert (math.isnan(at_10) and math.isnan(bad)) or at_10 == bad
    # the next interval had only finite losses: the report is the last step's loss again
    assert at_15 == pytest.approx(losses[14], rel=1e-6)
