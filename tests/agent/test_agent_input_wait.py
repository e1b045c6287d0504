"""Input wait (trainer_agent/measure/inputs.py through the agent): the time from one end_step to the next
forward, for any loader; it rises when a loader worker is slowed on purpose."""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import get_worker_info

import trainer_agent as ta
from trainer_agent.dataset import TokenBatches, TokenLoader, write_shards

VOCAB = 50


class SlowWorkerBatches(TokenBatches):
    """Worker 1's batches take ``delay`` seconds longer (a slow disk, a heavy transform)."""

    delay = 0.0

    def batch(self, epoch: int, batch: int) -> dict:
        info = get_worker_info()
        if info is not None and info.id == 1 and self.delay:
            time.sleep(self.delay)
        return super().batch(epoch, batch)


def _train(loader, steps: int) -> tuple[list[float], ta.Agent]:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = ta.attach(model, opt, job="wait", run="wait-1", config=ta.AgentConfig(report_every=4),
                      loader=loader if isinstance(loader, TokenLoader) else None)
    waits = []
    it = iter(loader)
    try:
        for _ in range(steps):
            batch = next(it)
            logits = model(batch["input_ids"])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch["input_ids"].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            agent.end_step(loss.detach(), tokens=int(batch["attention_mask"].sum()))
            waits.append(agent.latest().get("trainguard_input_wait_seconds", math.nan))
    finally:
        del it
        agent.close()
    return waits, agent


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(0)
    write_shards(root, (rng.integers(0, VOCAB, size=12) for _ in range(400)), vocab_size=VOCAB, monitor=False)
    return root


def test_input_wait_rises_when_a_worker_is_slowed(shards: Path) -> None:
    def loader(delay: float) -> TokenLoader:
        ds = SlowWorkerBatches(shards, batch_size=4, seq_len=12, rank=0, world_size=1)
        ds.delay = delay
        return TokenLoader(ds, num_workers=2, prefetch=2)

    fast, agent = _train(loader(0.0), 24)
    slow, _ = _train(loader(0.1), 24)
    fast_tail, slow_tail = np.array(fast[8:]), np.array(slow[8:])  # reports 2..5 (worker start-up excluded)
    # Worker 1 delivers every other batch at most every 0.1 s: a report of 4 steps waits about
    # 2 x 0.1 s in all, 0.05 s per step; the unslowed run waits far less. Generous margins.
    assert np.median(slow_tail) > 0.025 and np.median(slow_tail) > 5 * np.median(fast_tail), (fast_tail, slow_tail)
    values = agent.latest()
    assert "trainguard_input_tokens_per_second" in values and "trainguard_input_prefetch_depth" in values


def test_input_wait_of_any_loader_is_the_time_before_the_forward() -> None:
    now = [0.0]

    def clock() -> float:
        return now[0]

    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = ta.Agent(model, opt, job="j", run="r", config=ta.AgentConfig(report_every=2), clock=clock)
    try:
        gaps = [0.5, 0.25, 2.0, 1.0, 3.0]  # loader time before each forward
        for gap in gaps:
            now[0] += gap
            model(torch.ones(2, 3)).sum().backward()
            model(torch.ones(2, 3)).sum().backward()  # a second micro-batch: not input wait
            now[0] += 10.0  # compute
            opt.step()
            opt.zero_grad()
            agent.end_step(1.0)
        # step 1 has no previous end_step; report at step 2 holds step 2's wait, step 4's holds
        # the mean of steps 3 and 4
        assert agent.latest()["trainguard_input_wait_seconds"] == pytest.approx((2.0 + 1.0) / 2)
        assert agent.rank_values["input_wait_seconds"] == [pytest.approx(1.5)]
    finally:
        agent.close()
    with pytest.raises(ValueError, match="values"):
        ta.attach(model, opt, job="j", run="r", loader=object())
