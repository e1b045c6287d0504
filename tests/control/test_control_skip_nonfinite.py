"""skip_nonfinite: an error on one rank while reading its gradient flag must not skip the flag's
all-reduce that the other ranks enter (their collectives would pair with the wrong step's)."""

from __future__ import annotations

import gc
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.control.spawn import spawn_ranks

pytestmark = pytest.mark.distributed

WORLD = 2


class _FlakyReader:
    """Wraps the skip actuator's gradient-norm reader; raises the first time."""

    def __init__(self, read) -> None:
        self._read = read
        self._reads = 0

    def __call__(self):
        self._reads += 1
        if self._reads == 1:
            raise RuntimeError("injected failure reading the gradient norm")
        return self._read()


def _worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=8))
    import trainer_agent as ta

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = ta.attach(model, opt, job="skip", run="skip-err",
                      config=ta.AgentConfig(metrics_port=None, report_every=1, skip_nonfinite=True))
    if rank == 1:
        agent.control.skip.grad_norm = _FlakyReader(agent.control.skip.grad_norm)  # step 1, rank 1 only
    durations = []
    for step in range(1, 4):
        t0 = time.monotonic()
        loss = model(torch.ones(4, 3)).square().mean()
        if rank == 0 and step == 2:
            loss = loss * float("nan")  # non-finite gradients on rank 0: every rank skips step 2
        loss.backward()
        opt.step()
        opt.zero_grad()
        agent.end_step(loss)
        durations.append(time.monotonic() - t0)
    latest = agent.latest()
    agent.close()
    del agent
    gc.collect()
    dist.destroy_process_group()
    torch.save({"latest": latest, "durations": durations}, f"{out}/rank{rank}.pt")


def test_error_on_one_rank_keeps_the_skip_all_reduce(tmp_path) -> None:
    out = spawn_ranks(_worker, WORLD, tmp_path)
    assert [o["latest"]['trainguard_skipped_steps_total{reason="nonfinite"}'] for o in out] == [1.0, 1.0]
    assert out[0]["latest"]["trainguard_agent_errors_total"] == 0.0
    assert out[1]["latest"]["trainguard_agent_errors_total"] == 1.0
    assert max(d for o in out for d in o["durations"]) < 5.0  # nobody waited for a collective timeout
