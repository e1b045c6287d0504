"""In-memory snapshots and a snapshot backend: what is kept follows the retention rule, a backend
holds exactly the snapshots still kept (nothing leaks), and a restore loads the right one."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import trainer_agent as ta
from trainguard.protocol.retention import retained


class DictBackend:
    """A backend that keeps state dicts under a handle, as a checkpoint directory would."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt
        self.held: dict[str, tuple[dict, dict]] = {}
        self.loaded: list[str] = []

    def save(self, step: int) -> str:
        handle = f"step-{step}"
        self.held[handle] = (copy.deepcopy(self.model.state_dict()), copy.deepcopy(self.opt.state_dict()))
        return handle

    def load(self, handle: str) -> None:
        model_state, opt_state = self.held[handle]
        self.model.load_state_dict(model_state)
        self.opt.load_state_dict(copy.deepcopy(opt_state))
        self.loaded.append(handle)

    def drop(self, handle: str) -> None:
        del self.held[handle]


def _train(agent: ta.Agent, model: nn.Module, opt: torch.optim.Optimizer, steps: int, g: torch.Generator) -> None:
    for _ in range(steps):
        x = torch.randn(8, 4, generator=g)
        loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        agent.end_step(loss.detach())


def test_a_backend_holds_exactly_the_kept_snapshots_and_restores_the_one_asked_for() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    backend = DictBackend(model, opt)
    agent = ta.attach(model, opt, job="snap", run="snap-1", snapshot_backend=backend,
                      config=ta.AgentConfig(metrics_port=None, controller=None, snapshot_every=5, snapshot_keep=3))
    g = torch.Generator().manual_seed(1)
    try:
        kept: list[int] = []
        for step in range(5, 205, 5):
            _train(agent, model, opt, 5, g)
            kept = retained(kept + [step], every=5, keep=3)
            assert [s.step for s in agent.snapshots.snapshots] == kept
            assert sorted(backend.held) == sorted(f"step-{s}" for s in kept)  # dropped ones are freed
        target = kept[1]
        expected = backend.held[f"step-{target}"][0]
        assert agent.snapshots.restore(target + 3) == target  # the newest at or before the step asked
        assert backend.loaded == [f"step-{target}"]
        for name, t in model.state_dict().items():
            assert torch.equal(t, expected[name])
        assert sorted(backend.held) == sorted(f"step-{s}" for s in kept if s <= target)  # newer ones freed
        assert agent.snapshots.restore(kept[0] - 1) is None  # none that old: nothing changes
    finally:
        agent.close()


def test_snapshot_backend_mistakes_are_value_errors() -> None:
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="snapshot_every"):
        ta.attach(model, opt, job="snap", run="snap-2", snapshot_backend=DictBackend(model, opt),
                  config=ta.AgentConfig(metrics_port=None, controller=None))
    with pytest.raises(ValueError, match="drop"):
        ta.attach(model, opt, job="snap", run="snap-3", snapshot_backend=object(),
                  config=ta.AgentConfig(metrics_port=None, controller=None, snapshot_every=5))
