"""The agent's module hooks (trainer_agent/measure/module_hooks.py): a model can be copied after
``attach`` (an EMA of the weights, a reference model, ``torch.save(model)``), and the copy's
forward passes do not reach the agent."""

from __future__ import annotations

import copy
import io
import time
from pathlib import Path

import torch
from torch.optim import swa_utils

import trainer_agent as ta
from trainer_agent.measure.module_hooks import InertHook, ModuleHook

VOCAB = 50


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB))


def _hooks(model: torch.nn.Module) -> list[object]:
    return [*model._forward_pre_hooks.values(), *model._forward_hooks.values()]


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, agent: ta.Agent, ids: torch.Tensor) -> None:
    loss = torch.nn.functional.cross_entropy(model(ids).reshape(-1, VOCAB), ids.reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    agent.end_step(loss.detach())


def test_a_model_copied_after_attach_carries_inert_hooks_and_computes_the_same() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = ta.attach(model, opt, job="copies", run="copies-1",
                      config=ta.AgentConfig(metrics_port=None, report_every=1))
    try:
        ids = torch.randint(0, VOCAB, (4, 6))
        _step(model, opt, agent, ids)
        assert _hooks(model) and all(isinstance(h, ModuleHook) for h in _hooks(model))
        twin = copy.deepcopy(model)
        saved = io.BytesIO()
        torch.save(model, saved)
        saved.seek(0)
        loaded = torch.load(saved, weights_only=False)
        ema = swa_utils.AveragedModel(model, multi_avg_fn=swa_utils.get_ema_multi_avg_fn(0.9))
        for other in (twin, loaded, ema.module):
            assert len(_hooks(other)) == len(_hooks(model))
            assert all(isinstance(h, InertHook) for h in _hooks(other))
            assert torch.equal(other(ids), model(ids))
        _step(model, opt, agent, ids)
        ema.update_parameters(model)
        assert agent.latest()["trainguard_agent_errors_total"] == 0
    finally:
        agent.close()


def test_the_input_wait_is_measured_at_the_attached_model_not_at_its_copy() -> None:
    # An EMA copy's forward between end_step and the model's forward: with the agent's hooks copied
    # live, the wait would end at the copy's forward (~0 s) instead of the model's.
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = ta.attach(model, opt, job="copies", run="copies-2",
                      config=ta.AgentConfig(metrics_port=None, report_every=1))
    ema = swa_utils.AveragedModel(model)
    ids = torch.randint(0, VOCAB, (4, 6))
    waits = []
    try:
        for _ in range(3):
            with torch.no_grad():
                ema(ids)
            time.sleep(0.05)
            _step(model, opt, agent, ids)
            waits.append(agent.latest().get("trainguard_input_wait_seconds"))
    finally:
        agent.close()
    assert all(w >= 0.05 for w in waits[1:]), waits  # the first step has no previous end_step


def test_module_hook_calls_through_and_copies_to_a_hook_that_returns_none() -> None:
    calls = []
    hook = ModuleHook(lambda *args: calls.append(args) or "changed")
    assert hook(1, 2) == "changed" and calls == [(1, 2)]
    inert = copy.deepcopy(hook)
    assert isinstance(inert, InertHook) and inert(1, 2, output=3) is None and calls == [(1, 2)]
    assert copy.deepcopy(inert) is inert


def test_every_module_hook_of_the_agent_is_registered_through_module_hooks() -> None:
    # A hook registered directly would drag the agent into the model's copies again.
    package = Path(ta.__file__).parent
    direct = [str(p.relative_to(package)) for p in package.rglob("*.py")
              if p.name != "module_hooks.py" and ".register_forward" in p.read_text()]
    assert direct == []
