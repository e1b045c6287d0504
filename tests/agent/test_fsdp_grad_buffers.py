"""``fsdp_grad_buffers``: an ordinary step's gradient norm under FSDP2 from its flat gradient
buffers (one reduce-scatter output per ``fully_shard`` group), on real gloo ranks, against a
float64 reference after every backward pass: this rank's local gradients for its own norm, and
the ``full_tensor()`` gathers of every gradient for the global sum of squares that the ranks'
shares add up to. Shards with padding (13 rows over 2 ranks), a parameter left out of its group's
buffer on some steps (unused), a group not run at all on some steps, accumulation over two
micro-batches (with and without the gradient sync of the first), gradients set to None or zeroed,
the CPU's per-row norm and an accelerator's fused one, HSDP (2 x 2). The norm must equal the
reference wherever the buffers are used, and they must be used on the ordinary steps once found;
each report's largest gradient norm of its interval (the steps' shares summed at the report) must
equal the largest reference norm of its steps."""

from __future__ import annotations

import functools
import math
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import trainer_agent as ta
from tests.control.spawn import spawn_ranks

pytestmark = pytest.mark.distributed

STEPS = 14
REPORT_EVERY = 5


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(13)
        self.lin = nn.Linear(13, 13)
        self.sometimes = nn.Linear(13, 13)  # unused on every third step: left out of the buffer

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        x = x + torch.tanh(self.lin(self.norm(x)))
        return x + 0.5 * self.sometimes(x) if step % 3 else x


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 13)
        self.blocks = nn.ModuleList(_Block() for _ in range(4))
        self.rare = nn.Linear(13, 13)  # a group of its own, not run on steps 6 and 13
        self.head = nn.Linear(13, 1)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x, step)
        if step % 7 != 6:
            x = x + self.rare(x)
        return self.head(x).square().mean()


def _worker(rank: int, init: str, out: str, case: str, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainer_agent.measure import bucket_views, fsdp_grad_buffers

    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    bucket_views.ROW = 16  # the CPU's rows: rows and a rest in every buffer
    fsdp_grad_buffers.FsdpGradBuffers.cpu_rows = case != "fused"  # "fused": an accelerator's norm per buffer
    torch.manual_seed(0)
    net = _Net()
    mesh = (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")) if case == "hsdp"
            else init_device_mesh("cpu", (world,)))
    for module in (*net.blocks, net.rare):
        fully_shard(module, mesh=mesh)
    fully_shard(net, mesh=mesh)  # inp and head: the root's group
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    agent = ta.attach(net, opt, job="fsdp-buffers", run=f"fsdp-buffers-{case}",
                      config=ta.AgentConfig(metrics_port=None, report_every=REPORT_EVERY))
    params = list(net.parameters())
    gen = torch.Generator().manual_seed(1 + rank)
    records, buffers, reported = [], {}, {}
    for step in range(1, STEPS + 1):
        passes = 2 if step % 4 == 0 else 1
        for k in range(passes):
            sync = not (case == "no-sync" and k < passes - 1)
            net.set_requires_gradient_sync(sync)
            net(torch.randn(8, 7, generator=gen), step).backward()
            local = sum(float(p.grad.to_local().double().square().sum()) for p in params if p.grad is not None)
            full = sum(float(p.grad.full_tensor().double().square().sum()) for p in params if p.grad is not None)
            share = agent.parts.meter.state.grad_share.reshape(1).clone()
            dist.all_reduce(share)  # the ranks' shares of the global sum of squares, added up
            records.append((step, k, float(agent.parts.meter.grad_norm), math.sqrt(local), float(share), full))
        opt.step()
        opt.zero_grad(set_to_none=case != "zeroed")
        agent.end_step(torch.tensor(1.0))
        if step % REPORT_EVERY == 0:
            buffers[step] = len(agent.parts.params.bucket_views.groups or [])
            # The interval's largest gradient norm, from the steps' shares summed at the report,
            # against the reference norms of its steps (each step's after its last pass).
            interval = [math.sqrt(r[5]) for r in records if max(step - REPORT_EVERY, 1) < r[0] <= step  # (1: a report)
                        and r[1] == (2 if r[0] % 4 == 0 else 1) - 1]
            reported[step] = (agent.latest()["trainguard_grad_norm_max"], max(interval))
    torch.save({"records": records, "used": agent.parts.params.bucket_views.used, "buffers": buffers,
                "reported": reported},
               os.path.join(out, f"rank{rank}.pt"))
    agent.close()
    dist.destroy_process_group()


@pytest.mark.parametrize("case,world", [("set-to-none", 2), ("zeroed", 2), ("fused", 2), ("no-sync", 2),
                                        ("hsdp", 4)])
def test_ordinary_steps_take_the_norm_from_the_buffers_and_it_equals_every_grads(tmp_path, case: str,
                                                                               world: int) -> None:
    for result in spawn_ranks(functools.partial(_worker, case=case, world=world), world, tmp_path):
        for step, k, got, local, shares, full in result["records"]:
            assert math.isclose(got, local, rel_tol=2e-6), (step, k, got, local)
            assert math.isclose(shares, full, rel_tol=4e-6), (step, k, shares, full)
        for step, (got, want) in result["reported"].items():
            assert math.isclose(got, want, rel_tol=2e-6), (step, got, want)
        # Found on the report steps 1, 5 and 10 (every group ran whole), six buffers: four blocks,
        # the rare layer, the root's inp and head.
        assert result["buffers"] == {5: 6, 10: 6}
        # Used on the ordinary steps after them (2-4, 6-9, 11-14), once per backward pass (two on steps
        # 4, 8 and 12), where the gradients are views of buffers of the layout found: not where a
        # block's ``sometimes`` is unused (steps 6, 9 and 12: shorter buffers) or ``rare`` did not
        # run (13: no gradient), nor after a first pass without the gradient sync (no views yet).
        # Zeroed gradients stay views of the first step's buffers: used on every pass.
        expected = {"set-to-none": 8, "fused": 8, "hsdp": 8, "no-sync": 6, "zeroed": 14}[case]
        assert result["used"] == expected


def test_tensor_parallel_gradients_are_normed_per_tensor(tmp_path) -> None:
    """Under a tensor-parallel plan the gradients are tensors of their own, no views of a flat
    buffer, and a replicated parameter (the row-wise layer's bias) counts on one rank only (rank
    1's shares differ per parameter: nothing is looked for there). No buffer is found or used; the values are
    ``test_sharding.py``'s."""
    results = spawn_ranks(_tp_worker, 2, tmp_path)
    assert results[1]["applies"] is False
    for result in results:
        assert (result["found"], result["used"]) == (False, 0)


def _tp_worker(rank: int, init: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6))  # the row-wise bias: replicated
    parallelize_module(model, init_device_mesh("cpu", (2,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = ta.attach(model, opt, job="fsdp-buffers", run="tp", config=ta.AgentConfig(metrics_port=None, report_every=2))
    for step in range(5):
        model(torch.randn(4, 6, generator=torch.Generator().manual_seed(step))).square().mean().backward()
        opt.step()
        opt.zero_grad()
        agent.end_step(torch.tensor(1.0))
    views = agent.parts.params.bucket_views
    torch.save({"applies": views is not None, "found": views is not None and views.groups is not None,
                "used": views.used if views is not None else 0}, os.path.join(out, f"rank{rank}.pt"))
    agent.close()
    dist.destroy_process_group()
