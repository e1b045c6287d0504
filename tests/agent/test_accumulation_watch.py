"""A steady loop that changes its micro-batches per optimizer step is a change of the run
(``trainer_agent/measure/accumulation_watch.py``): counted from the backward passes of a real
training loop, the spike guard takes the first spike after it, while a poisoned batch in a loop
whose count varies from step to step is still skipped."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import trainer_agent as ta
from trainer_agent.measure.accumulation_watch import HOLD_STEPS, AccumulationWatch


def _marks(counts: list[int]) -> list[int]:
    watch = AccumulationWatch()
    return [i for i, c in enumerate(counts) if watch.step_ended(c) is not None]


def test_a_steady_count_that_changes_is_marked_once_at_its_first_step() -> None:
    assert _marks([4] * HOLD_STEPS + [1] * 200) == [HOLD_STEPS]
    assert _marks([4] * (HOLD_STEPS - 1) + [1] * 200) == []  # not held long enough
    assert _marks([4] * HOLD_STEPS + [1] * HOLD_STEPS + [2]) == [HOLD_STEPS, 2 * HOLD_STEPS]


def test_an_epoch_that_ends_with_a_shorter_step_is_marked_there_only() -> None:
    epoch = [4] * 100 + [2]
    assert _marks(epoch * 3) == [100, 201, 302]


def test_a_count_that_varies_from_step_to_step_and_steps_without_backward_are_never_marked() -> None:
    assert _marks([3, 4, 5] * 200) == []
    assert _marks([4] * HOLD_STEPS + [0] * 5 + [4] * 10) == []  # a step without a backward pass is not counted
    watch = AccumulationWatch()
    for _ in range(HOLD_STEPS):
        watch.step_ended(4)
    assert watch.changes(1) and not watch.changes(4) and not watch.changes(0)


def _train(counts: list[int], *, summed_from: int | None = None, poison_at: int | None = None):
    """A small regression MLP with AdamW, ``counts[k]`` micro-batches of 16 samples at step k + 1,
    their losses averaged (summed, one micro-batch's loss x8, from step ``summed_from``: the
    gradient's level jumps as when a loop switches to summed micro-batches); at ``poison_at`` every
    micro-batch scaled x1000."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    agent = ta.attach(model, opt, job="accumulation", run="accumulation-0",
                      config=ta.AgentConfig(metrics_port=None, report_every=10, skip_spikes=True, controller=None))
    g = torch.Generator().manual_seed(100)
    w_true = torch.randn(16, 1, generator=g)
    for step, count in enumerate(counts, start=1):
        for _ in range(count):
            x = torch.randn(16, 16, generator=g)
            y = x @ w_true + 0.1 * torch.randn(16, 1, generator=g)
            if step == poison_at:
                x = x * 1000.0
            loss = nn.functional.mse_loss(model(x), y)
            scale = 8.0 if summed_from is not None and step >= summed_from else 1.0 / count
            (loss * scale).backward()
        opt.step()
        opt.zero_grad()
        agent.end_step(loss)
    return agent


def test_a_cut_of_the_accumulation_to_summed_micro_batches_is_taken_not_skipped() -> None:
    """Unmarked, the guard skipped 16 steps in a row at the cut (norms ~8x the median of 0.55)."""
    agent = _train([4] * 300 + [1] * 100, summed_from=301)
    try:
        assert agent.control.skip.skipped_by_reason["spike"] == 0
        assert agent.state_dict()["run_changes_total"] == 1
        assert agent.latest()["trainguard_run_changes_total"] == 1.0
    finally:
        agent.close()


@pytest.mark.parametrize("counts", [[3, 4, 5] * 60, [4] * 180], ids=["varying", "steady"])
def test_a_poisoned_batch_is_still_skipped(counts: list[int]) -> None:
    agent = _train(counts, poison_at=150)
    try:
        assert agent.control.skip.skipped_by_reason["spike"] == 1
        assert agent.state_dict()["run_changes_total"] == 0
    finally:
        agent.close()
