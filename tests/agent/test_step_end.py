"""The close of a step (trainer_agent/agent_parts/step_end.py): a loop that calls ``end_step`` per
micro-batch instead of once per optimizer step is told so, once; a loop that skips a rare step of
its own, or accumulates and calls ``end_step`` after the optimizer step, is not."""

from __future__ import annotations

import logging

import pytest
import torch

import trainer_agent as ta

ACCUMULATION = 4


def _warnings(caplog: pytest.LogCaptureFixture, mode: str, steps: int = 60) -> tuple[list[str], int]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = ta.attach(model, opt, job="j", run=f"r-{mode}", config=ta.AgentConfig(metrics_port=None, report_every=10))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainer_agent.agent"):
        for k in range(steps):
            for m in range(ACCUMULATION):
                loss = model(torch.randn(2, 4)).square().mean() / ACCUMULATION
                loss.backward()
                if mode == "per_micro_batch" and m < ACCUMULATION - 1:
                    agent.end_step(loss.detach())
            if mode == "own_skips" and k % 10 == 9:
                opt.zero_grad()  # the loop's own skip of a step (e.g. a non-finite loss it guards against)
            else:
                opt.step()
                opt.zero_grad()
            agent.end_step(loss.detach())
    step = agent.step
    agent.close()
    return [r.getMessage() for r in caplog.records if "end_step calls" in r.getMessage()], step


def test_end_step_per_micro_batch_is_told_once(caplog: pytest.LogCaptureFixture) -> None:
    found, step = _warnings(caplog, "per_micro_batch")
    assert step == 60 * ACCUMULATION  # what the agent counted: one step per call
    (warning,) = found
    assert warning.startswith("trainguard: 24 of the first 32 end_step calls closed a step in which optimizer.step() "
                              "did not run")  # 3 in every 4 calls
    assert "once per optimizer step" in warning


@pytest.mark.parametrize("mode", ["once_per_optimizer_step", "own_skips"])
def test_a_loop_calling_end_step_per_optimizer_step_is_not_warned(caplog: pytest.LogCaptureFixture, mode: str) -> None:
    found, step = _warnings(caplog, mode)
    assert step == 60 and found == []
