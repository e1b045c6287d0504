"""Data parallelism: two real processes (gloo), DistributedDataParallel, one micro-batch each.

The noise scale then comes from the ranks' local gradients (before the all-reduce) against the
all-reduced one; the global gradient norm is the all-reduced gradient's; per-rank values are
gathered on every rank.
"""

from __future__ import annotations

import gc
import math
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.control.spawn import spawn_ranks

pytestmark = pytest.mark.distributed

WORLD, TOKENS = 2, 24


def _worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    import trainer_agent as ta

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    local: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        p.register_hook(lambda g, name=name: local.__setitem__(name, g.detach().double().clone()))
    agent = ta.attach(ddp, opt, job="ddp", run="ddp-1",
                      config=ta.AgentConfig(metrics_port=0, report_every=2, layer_depth=1))
    results = []
    for step in range(2):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(8, 6, generator=g)
        loss = ddp(x).square().mean()
        loss.backward()
        reduced = {n: p.grad.double().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        agent.end_step(loss, tokens=TOKENS)
        gathered: list[dict[str, torch.Tensor]] = [None] * WORLD  # type: ignore[list-item]
        dist.all_gather_object(gathered, local)
        results.append({"loss": float(loss), "reduced": reduced, "locals": gathered})
    latest = agent.latest()
    rank_values = agent.rank_values
    url = agent.metrics_url
    agent.close()
    del agent, ddp  # DDP holds the process group: free it before the group goes (clean exit)
    gc.collect()
    dist.destroy_process_group()
    torch.save({"latest": latest, "rank_values": rank_values, "url": url, "results": results},
               f"{out}/rank{rank}.pt")


def _sq(tensors) -> float:
    return sum(float((t * t).sum()) for t in tensors)


def test_ddp_noise_scale_and_rank_values(tmp_path) -> None:
    out = spawn_ranks(_worker, WORLD, tmp_path)
    last = out[0]["results"][-1]
    reduced = last["reduced"]
    # DDP averages: the reduced gradient is the mean of the ranks' local gradients.
    for name, g in reduced.items():
        assert torch.allclose(g, sum(loc[name] for loc in last["locals"]) / WORLD, rtol=1e-6)
    got = out[0]["latest"]
    assert got["trainguard_grad_norm"] == pytest.approx(math.sqrt(_sq(reduced.values())), rel=1e-5)
    # McCandlish, appendix A.1: B_small = one rank's batch, B_big = both ranks'.
    b_small, b_big = TOKENS, WORLD * TOKENS
    g_small = sum(_sq(loc.values()) for loc in last["locals"]) / WORLD
    g_big = _sq(reduced.values())
    g2 = (b_big * g_big - b_small * g_small) / (b_big - b_small)
    s = (g_small - g_big) / (1 / b_small - 1 / b_big)
    assert got["trainguard_grad_noise_scale"] == pytest.approx(s / g2, rel=1e-5)
    assert got["trainguard_grad_variance"] == pytest.approx(s, rel=1e-5)
    # Every rank holds every rank's values of the report; ports are base + local rank.
    for r in range(WORLD):
        rv = out[r]["rank_values"]
        assert rv["loss"] == pytest.approx([o["results"][-1]["loss"] for o in out], rel=1e-6)
        assert rv["micro_count"] == [1.0, 1.0]
        assert out[r]["latest"]["trainguard_step"] == 2
    assert out[0]["url"] != out[1]["url"]
    assert 'trainguard_layer_grad_norm{layer="0"}' in got  # "module." of DDP is not a layer
    assert not any("layer=" in k for k in out[1]["latest"])  # per_layer="rank0" by default
