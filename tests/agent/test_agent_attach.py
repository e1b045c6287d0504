"""An attach that fails after the agent hooked the optimizer (here: a registry refusing the
agent's collector as a duplicate) must leave no hooks and no worker thread behind."""

from __future__ import annotations

import threading

import pytest
import torch
from prometheus_client.registry import CollectorRegistry

import trainer_agent as ta


def test_failed_attach_removes_its_hooks_and_threads() -> None:
    registry = CollectorRegistry(auto_describe=True)  # like prometheus_client.REGISTRY
    first_model = torch.nn.Linear(3, 2)
    first = ta.attach(first_model, torch.optim.SGD(first_model.parameters(), lr=0.1), job="j", run="r-1",
                      config=ta.AgentConfig(metrics_port=None), registry=registry)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    threads = set(threading.enumerate())
    try:
        with pytest.raises(ValueError, match="Duplicated"):
            ta.attach(model, opt, job="j", run="r-2", registry=registry,
                      config=ta.AgentConfig(metrics_port=None, vocab_size=16))
        assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
        assert all(not p._backward_hooks for p in model.parameters())
        leaked = [t for t in threading.enumerate() if t not in threads and t.is_alive()]
        assert not leaked, leaked
    finally:
        first.close()


def test_lr_scheduler_is_saved_and_restored_with_the_agent_state() -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    agent = ta.attach(model, opt, job="j", run="r", lr_scheduler=sched, config=ta.AgentConfig(metrics_port=None))
    try:
        for _ in range(3):
            model(torch.ones(1, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            agent.end_step(0.0)
        saved = agent.state_dict()
        assert saved["lr_scheduler"] == sched.state_dict() and saved["lr_scheduler"]["last_epoch"] == 3
        for _ in range(4):
            sched.step()
        assert sched.last_epoch == 7
        agent.load_state_dict(saved)
        assert sched.last_epoch == 3 and sched.get_last_lr() == [0.5]  # 1.0 * 0.5 ** (3 // 2)
    finally:
        agent.close()
    with pytest.raises(ValueError, match="lr_scheduler"):
        ta.attach(model, opt, job="j", run="r", lr_scheduler=object())
