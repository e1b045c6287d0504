"""trainer_agent/integrations/__init__.py: what both framework callbacks do around the agent
(StepSession), framework-free, and the token count of a batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import trainer_agent as ta
from trainer_agent.integrations import StepSession, tokens_of


def _session(**kwargs) -> StepSession:  # type: ignore[no-untyped-def]
    kwargs.setdefault("config", ta.AgentConfig(metrics_port=None, report_every=1))
    return StepSession("job-s", "run-s", kwargs)


def test_a_step_loss_is_the_scaled_sum_of_its_micro_batches_and_tokens_add_up() -> None:
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = _session()
    agent = session.attach(model, opt)
    assert session.attach(model, opt) is agent  # once per fit
    assert session.end_step() is False and agent.step == 0  # no micro-batch seen: no step
    micro = [torch.tensor(0.25), torch.tensor(0.5), torch.tensor(1.75)]
    for loss, tokens in zip(micro, (4, 4, 2)):
        session.add_micro_batch(loss, tokens)
    assert session.micro_batches == 3
    opt.step()
    t0 = agent.clock.last_end
    assert session.end_step(scale=4 / 3) is True  # e.g. Lightning: each was divided by 4
    latest = agent.latest()
    assert latest["trainguard_loss"] == pytest.approx((0.25 + 0.5 + 1.75) * 4 / 3, rel=1e-7)
    assert latest["trainguard_global_batch_size"] == 10  # (the warm-up step: no step time nor throughput)
    assert agent.clock.last_end > t0 and session.micro_batches == 0
    session.add_micro_batch(torch.tensor(1.0), None)  # a batch without a token count: the step has none
    session.add_micro_batch(torch.tensor(1.0), 5)
    session.end_step()
    assert agent.latest()["trainguard_loss"] == 2.0 and "trainguard_tokens_per_second" not in agent.latest()
    session.add_micro_batch(None, 3)  # not a loss: counted, not raised
    assert session.micro_batches == 0 and agent.latest()["trainguard_agent_errors_total"] == 1.0
    session.close()
    session.close()  # idempotent
    assert agent._closed and session.attach(model, opt) is not agent  # a second fit: a new agent
    session.close()


def test_the_controllers_checkpoint_request_is_taken_once() -> None:
    session = _session()
    assert session.take_checkpoint_request() is False
    session._on_checkpoint(7)  # what the control plane calls on a checkpoint command or a stop
    assert session.take_checkpoint_request() is True and session.take_checkpoint_request() is False


def test_on_checkpoint_belongs_to_the_callback() -> None:
    with pytest.raises(ValueError, match="on_checkpoint"):
        StepSession("j", "r", {"on_checkpoint": print})


def test_bad_names_are_refused_at_attach() -> None:
    model = nn.Linear(2, 1)
    with pytest.raises(ValueError, match="run must match"):
        StepSession("job", "bad run!", {}).attach(model, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize(
    ("batch", "tokens"),
    [
        ({"input_ids": torch.zeros(2, 8, dtype=torch.long)}, 16),
        (torch.zeros(3, 5, dtype=torch.int32), 15),
        ((torch.zeros(4, 2, dtype=torch.long), torch.zeros(4)), 8),
        ([torch.zeros(4, 3)], None),  # features, not tokens
        ({"pixels": torch.zeros(2, 3)}, None),
        (None, None),
        ("text", None),
    ],
)
def test_tokens_of(batch, tokens) -> None:  # type: ignore[no-untyped-def]
    assert tokens_of(batch) == tokens
