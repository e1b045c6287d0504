"""The close of a step (trainer_agent/agent_parts/step_end.py): a loop that calls ``end_step`` per
micro-batch instead of once per optimizer step is told so, once; a loop that skips a rare step of
its own, or accumulates and calls ``end_step`` after the optimizer step, is not."""

from __future__ import annotations

import logging
import warnings

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


def _closed_agent(run: str) -> tuple[ta.Agent, torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = ta.attach(model, opt, job="j", run=run, config=ta.AgentConfig(metrics_port=None, report_every=2))
    for _ in range(3):
        model(torch.randn(2, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        agent.end_step(1.0)
    agent.close()
    return agent, model, opt


def test_end_step_after_close_is_warned_once_and_does_nothing() -> None:
    agent, model, opt = _closed_agent("r-closed")
    reported = agent.latest()["trainguard_step"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning recorded: the agent itself gives just one
        for _ in range(5):  # a loop that goes on after a framework callback closed the agent
            model(torch.randn(2, 4)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            agent.end_step(torch.tensor(2.0))
        _, other_model, other_opt = _closed_agent("r-closed-2")
        other = ta.attach(other_model, other_opt, job="j", run="r-closed-3",
                          config=ta.AgentConfig(metrics_port=None))
        other.close()
        other.end_step(1.0)  # another agent: warned of its own
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert messages[0].startswith("trainguard: end_step of run 'r-closed' after the agent was closed")
    assert messages[1].startswith("trainguard: end_step of run 'r-closed-3' after the agent was closed")
    assert caught[0].filename == __file__  # it points at the loop's end_step call
    assert agent.step == 3  # the 3 steps before close
    assert agent.latest()["trainguard_step"] == reported == 2.0  # no report built after close
    assert agent.errors.count == 0


def test_a_step_without_a_loss_counts_and_invents_no_loss() -> None:
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = ta.attach(model, opt, job="j", run="r-no-loss", config=ta.AgentConfig(metrics_port=None, report_every=2))
    reports = []
    for loss in (None, None, 3.0, None, None, None):
        if loss is not None:
            model(torch.randn(2, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        agent.end_step(loss)
        reports.append(dict(agent.latest()))
    agent.close()
    assert agent.step == 6
    assert reports[1]["trainguard_step"] == 2.0 and "trainguard_loss" not in reports[1]  # no step had a loss yet
    assert reports[3]["trainguard_step"] == 4.0 and reports[3]["trainguard_loss"] == 3.0
    assert reports[5]["trainguard_step"] == 6.0 and reports[5]["trainguard_loss"] == 3.0  # the last loss a step had
    assert reports[5]["trainguard_nonfinite_steps_total"] == 0.0 and agent.errors.count == 0
