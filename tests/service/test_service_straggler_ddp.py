"""Straggler detection under data parallelism, end to end: a real 2-rank DDP job (gloo, CPU) with
the agent attached reports to a real controller; rank 1 is slow either in its forward pass
(compute-slow) or in getting its next batch (data-slow). The gradient all-reduce makes both ranks'
step times equal, so the step-time rule cannot see either; the forward-time rule names the first,
the input-wait rule the second."""

from __future__ import annotations

import gc
import os
import time
from datetime import timedelta

import httpx
import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.control.spawn import spawn_ranks

SLOW_S = 0.05
STEPS = 12


class Sleepy(nn.Module):
    def __init__(self, sleep: float) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.sleep = sleep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sleep:
            time.sleep(self.sleep)  # the slow rank's extra compute (the workload, not a synchronisation)
        return self.lin(x)


def _worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    import trainer_agent as ta

    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(Sleepy(0.0))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    mode = os.environ["STRAGGLER_MODE"]
    ddp.module.sleep = SLOW_S if rank == 1 and mode == "compute" else 0.0
    agent = ta.attach(ddp, opt, job="ddp-straggler", run="ddp-straggler-1",
                      config=ta.AgentConfig(metrics_port=None, report_every=1))
    for _ in range(STEPS):
        if rank == 1 and mode == "data":
            time.sleep(SLOW_S)  # a loader that cannot keep up (the workload, not a synchronisation)
        ddp(torch.randn(8, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        agent.end_step(0.0)
    torch.save({"rank_values": agent.rank_values}, f"{out}/rank{rank}.pt")
    agent.close()
    del agent, ddp
    gc.collect()
    dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.parametrize("mode,rule,vector", [("compute", "forward_time_straggler", "forward_seconds"),
                                              ("data", "input_wait_straggler", "input_wait_seconds")])
def test_a_slow_rank_fires_its_rule_not_the_step_time_rule(tmp_path, serve, monkeypatch, mode, rule, vector) -> None:
    srv = serve(tmp_path / "tg.db")
    monkeypatch.setenv("TRAINGUARD_CONTROLLER", srv.url)
    monkeypatch.setenv("STRAGGLER_MODE", mode)
    (tmp_path / "ranks").mkdir()
    out = spawn_ranks(_worker, 2, tmp_path / "ranks", timeout=180)
    per_rank = out[0]["rank_values"].get(vector)
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        reports = c.get("/v1/runs/ddp-straggler-1").json()["reports"]
        rules = {a["rule"] for a in c.get("/v1/alerts", params={"run": "ddp-straggler-1"}).json()}
    assert reports >= 3
    assert rule in rules, (rules, out[0]["rank_values"])
    assert "step_time_straggler" not in rules, rules
    other = {"forward_time_straggler", "input_wait_straggler"} - {rule}
    assert not rules & other, rules  # the other kind of slowness is not claimed
    assert per_rank is not None and per_rank[1] >= SLOW_S > per_rank[0], per_rank  # rank 1 is the slow one
