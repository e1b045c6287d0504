"""The agent's error log (trainer_agent/agent_parts/errors.py): ``agent.errors.count`` is the count
``trainguard_agent_errors_total`` exports, the data feed's bad batches included."""

from __future__ import annotations

import torch
from torch import nn

import trainer_agent as ta


class MisspeltLoader:
    """A loader whose values() names a metric the catalogue does not know (one agent error)."""

    def values(self) -> dict[str, float]:
        return {"trainguard_input_prefetch_dept": 3.0}


def test_error_count_is_the_exported_count_with_bad_batches() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = ta.attach(model, opt, job="j", run="r", loader=MisspeltLoader(),
                      config=ta.AgentConfig(metrics_port=None, report_every=2, vocab_size=10))
    try:
        agent.observe_batch(torch.tensor([[1, 2, 99]]))  # an id outside the vocabulary: a bad batch
        agent.observe_batch(torch.tensor([[1, 2, 3]]))
        for _ in range(2):
            model(torch.randn(2, 4)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            agent.end_step(1.0)
        exported = agent.latest()["trainguard_agent_errors_total"]  # waits for the feed's batches
        assert exported == 2.0  # the bad batch and the unknown loader value
        assert agent.errors.count == 2
    finally:
        agent.close()
