"""FSDP2 on one rank with the agent: its gradient norms against ``clip_grad_norm_``'s, and its share of the step.

    .venv/bin/python bench/fsdp2_one_rank.py --device cuda     # NCCL, a world of one (bench/device_check.sh)
    .venv/bin/python bench/fsdp2_one_rank.py --device cpu      # gloo: the same code on the CPU

A stack of MLP blocks, each ``fully_shard``-ed and the root too, trains with AdamW; the agent
reports every ``--report-every`` steps, so the ordinary steps take the gradient norm from FSDP2's
flat gradient buffers (``trainer_agent/measure/fsdp_grad_buffers.py``) and the report steps per
tensor. Each report's ``grad_norm`` is compared with ``clip_grad_norm_``'s of its step and its
``grad_norm_max`` with the largest of its interval (the steps since the previous report, ordinary
ones included). Prints one line; exits 1 when the worst relative difference is over ``--rtol``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

import trainer_agent as ta


def model_for(device: torch.device, width: int, blocks: int) -> nn.Module:
    """``blocks`` MLP blocks of ``width``, each sharded by FSDP2, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                            for _ in range(blocks)]).to(device)
    mesh = init_device_mesh(device.type, (1,))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def worst_difference(reports: list[tuple[int, float, float]], refs: list[float]) -> float:
    """The largest relative difference of the reports ``(step, grad_norm, grad_norm_max)`` (steps
    from 1) from the references (``refs[s - 1]``: step s's ``clip_grad_norm_``): the norm against
    its step's, the maximum against the largest of the steps since the previous report."""
    worst, previous = 0.0, 0
    for step, norm, largest in reports:
        for got, want in ((norm, refs[step - 1]), (largest, max(refs[previous:step]))):
            diff = abs(got - want) / abs(want) if want else abs(got)
            worst = max(worst, diff if diff == diff else float("inf"))  # a NaN reading is the worst
        previous = step
    return worst


def run(device: torch.device, steps: int, report_every: int, width: int, blocks: int) -> tuple[float, int, int, float]:
    """(worst relative difference, ordinary steps normed from the flat buffers, ordinary steps,
    the agent's share of the steps' wall time)."""
    model = model_for(device, width, blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    agent = ta.attach(model, opt, job="device-check", run="fsdp2",
                      config=ta.AgentConfig(metrics_port=None, report_every=report_every))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    x = torch.randn(32, width, device=device)
    refs: list[float] = []
    reports: list[tuple[int, float, float]] = []
    wall = 0.0
    try:
        for step in range(1, steps + 1):
            sync()
            t0 = time.perf_counter()
            loss = model(x + 0.01 * step).square().mean()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))  # grads times 1: unchanged
            opt.step()
            opt.zero_grad()
            agent.end_step(loss)
            sync()
            wall += time.perf_counter() - t0
            refs.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
            got = agent.latest()  # (waits for a report's copy: outside the timed step)
            if got.get("trainguard_step") == step:
                reports.append((step, got["trainguard_grad_norm"], got["trainguard_grad_norm_max"]))
        if not reports or agent.latest()["trainguard_agent_errors_total"]:
            raise SystemExit(f"fsdp2: {len(reports)} reports, agent errors "
                             f"{agent.latest()['trainguard_agent_errors_total']:g}")
        buffers = agent.parts.params.bucket_views
        used = buffers.used if buffers is not None else 0
        return worst_difference(reports, refs), used, steps - len(reports), agent.overhead_seconds_total / wall
    finally:
        agent.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (NCCL) or cpu (gloo)")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--report-every", type=int, default=5)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--rtol", type=float, default=1e-4, help="largest relative difference accepted")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("fsdp2_one_rank: --device cuda, but no CUDA device is available")
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{tmp}/store",
                                rank=0, world_size=1)
        try:
            worst, used, ordinary, share = run(device, args.steps, args.report_every, args.width, args.blocks)
        finally:
            dist.destroy_process_group()
    print(f"fsdp2 1 rank ({device.type}): grad_norm and interval max vs clip_grad_norm_ worst rel diff {worst:.2e} "
          f"(rtol {args.rtol:g}); {used} of {ordinary} ordinary steps from the flat buffers; "
          f"agent {share:.1%} of wall time (host)", flush=True)
    if not worst <= args.rtol:
        sys.exit(1)


if __name__ == "__main__":
    main()
