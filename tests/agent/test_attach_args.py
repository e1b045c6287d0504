"""The checks of ``attach``'s and ``end_step``'s arguments (trainer_agent/agent_parts/attach_args.py):
a loss or token count that cannot be one raises ``ValueError`` at the first ``end_step``, before the
agent's step moves; a token count held in a tensor is read on report steps."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import trainer_agent as ta
from trainer_agent.agent_parts.attach_args import checked_end_step

VOCAB = 50


@pytest.fixture()
def loop():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = ta.attach(model, opt, job="args", run="args-1", config=ta.AgentConfig(metrics_port=None, report_every=1))
    ids = torch.randint(0, VOCAB, (4, 6))

    def step() -> torch.Tensor:
        loss = torch.nn.functional.cross_entropy(model(ids).reshape(-1, VOCAB), ids.reshape(-1), reduction="none")
        loss.mean().backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    yield agent, step
    agent.close()


@pytest.mark.parametrize(("loss", "tokens", "message"), [
    ("per_sample", None, r"one real value \(e.g. loss.mean\(\)\), got a tensor of shape \(24,\)"),
    (b"1", None, "loss must be a tensor of one element, a real number or None, got b'1'"),
    ("2.5", None, "got '2.5'"),
    ("mean", -1, "non-negative number, got -1"),
    ("mean", math.nan, "non-negative number, got nan"),
    ("mean", "24", "got '24'"),
    ("mean", True, "got True"),
    ("mean", torch.tensor([12, 12]), r"one value, got a tensor of shape \(2,\)"),
    (10**400, None, "within float64's range, got an int of 401 digits"),
    (torch.tensor(True), None, "dtype torch.bool"),
])
def test_a_loss_or_token_count_that_cannot_be_one_raises_before_the_step_moves(loop, loss, tokens, message) -> None:  # type: ignore[no-untyped-def]
    agent, step = loop
    losses = step()
    value = {"per_sample": losses, "mean": losses.mean()}.get(loss, loss) if isinstance(loss, str) else loss
    with pytest.raises(ValueError, match=message):
        agent.end_step(value, tokens=tokens)
    assert agent.step == 0
    agent.end_step(losses.mean(), tokens=24)  # the loop goes on once the call is mended
    assert agent.step == 1
    assert agent.latest()["trainguard_loss"] == pytest.approx(float(losses.mean()))
    assert agent.latest()["trainguard_agent_errors_total"] == 0


def test_a_token_count_in_a_tensor_is_read_on_the_report_step(loop) -> None:  # type: ignore[no-untyped-def]
    agent, step = loop
    agent.end_step(step().mean(), tokens=24)  # the warm-up step: no step time nor throughput
    for tokens in (torch.tensor(24), torch.tensor(24.0), np.int64(24), 24.0):
        agent.end_step(step().mean(), tokens=tokens)
        values = agent.latest()
        assert values["trainguard_tokens_per_second"] == pytest.approx(24 / values["trainguard_step_duration_seconds"])
        assert type(values["trainguard_tokens_per_second"]) is float
    agent.end_step(step().mean(), tokens=torch.tensor(-3))  # only a read tells: left out and counted
    values = agent.latest()
    assert "trainguard_tokens_per_second" not in values
    assert values["trainguard_agent_errors_total"] == 1
    assert values["trainguard_step"] == 6


def test_nan_and_inf_losses_pass_as_values() -> None:
    for loss in (math.nan, math.inf, torch.tensor(math.nan), torch.tensor([math.inf]), np.float32(-math.inf)):
        checked, _ = checked_end_step(loss, None)
        assert not math.isfinite(float(checked))


def test_an_optimizer_of_none_of_the_models_parameters_is_refused_at_attach() -> None:
    model, other = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="the optimizer holds none of the model's parameters \\(2 in the model, 2 in"):
        ta.attach(model, opt, job="j", run="r", config=ta.AgentConfig(metrics_port=None))
    with pytest.raises(ValueError, match="0 in the model"):
        ta.attach(torch.nn.ReLU(), opt, job="j", run="r", config=ta.AgentConfig(metrics_port=None))
    # An optimizer holding the model's parameters and one more (a learned temperature, say) is fine.
    extra = torch.nn.Parameter(torch.ones(()))
    both = torch.optim.SGD([*model.parameters(), extra], lr=0.1)
    ta.attach(model, both, job="j", run="r", config=ta.AgentConfig(metrics_port=None)).close()


def test_close_refuses_a_timeout_it_cannot_wait_and_stays_open_until_a_good_one() -> None:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = ta.attach(model, opt, job="j", run="r", config=ta.AgentConfig(metrics_port=0))
    url = agent.metrics_url
    for bad in (math.inf, 1e30, -1, "abc", True):
        with pytest.raises(ValueError, match="timeout must be None or a number of seconds"):
            agent.close(timeout=bad)
    import urllib.request

    assert urllib.request.urlopen(url, timeout=5).status == 200  # still serving: nothing was closed
    agent.close(timeout=5)
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=5)


def test_gradients_from_autograd_grad_set_by_hand_are_measured() -> None:
    """A loop that takes its gradients with ``torch.autograd.grad`` and sets ``.grad`` itself: that
    pass writes no ``.grad``, so the norm is the one the optimizer is given (it read 0 before)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = ta.attach(model, opt, job="j", run="r", config=ta.AgentConfig(metrics_port=None, report_every=1))
    x = torch.randn(8, 4)
    try:
        for _ in range(3):
            loss = model(x).pow(2).mean()
            grads = torch.autograd.grad(loss, list(model.parameters()))
            for p, g in zip(model.parameters(), grads):
                p.grad = g
            want = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
            opt.step()
            opt.zero_grad()
            agent.end_step(loss.detach())
            assert agent.latest()["trainguard_grad_norm"] == pytest.approx(want, rel=1e-6)
    finally:
        agent.close()
