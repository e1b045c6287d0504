"""``step_stats``: the gradient norm under a GradScaler with an extreme (finite) scale."""

from __future__ import annotations

import math

import torch
from torch import nn

import trainer_agent as ta


def test_grad_norm_is_right_for_a_scale_of_2_pow_127() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127, growth_interval=1000)
    agent = ta.attach(model, opt, job="scale", run="scale-1", scaler=scaler,
                      config=ta.AgentConfig(metrics_port=None, report_every=1, per_layer="all", layer_depth=1))
    loss = model(torch.randn(8, 16)).square().mean()
    scaler.scale(loss).backward()
    scaled = [p.grad.double() for p in model.parameters()]
    # The scaled gradients are finite, but the sum of their squares is not, in float32.
    assert all(torch.isfinite(g.float()).all() for g in scaled)
    assert not math.isfinite(float(torch.linalg.vector_norm(torch.cat([g.float().reshape(-1) for g in scaled]))))
    true = math.sqrt(sum(float((g / 2.0**127).square().sum()) for g in scaled))
    layer0 = math.sqrt(sum(float((g / 2.0**127).square().sum()) for g in scaled[:2]))
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    agent.end_step(loss)
    latest = agent.latest()
    agent.close()
    assert math.isclose(latest["trainguard_grad_norm"], true, rel_tol=1e-6)
    assert math.isclose(latest['trainguard_layer_grad_norm{layer="0"}'], layer0, rel_tol=1e-6)
    assert latest["trainguard_nonfinite_grads"] == 0.0
    assert latest["trainguard_agent_errors_total"] == 0.0


def test_sums_and_extremes_match_a_float64_reference_per_tensor() -> None:
    from trainer_agent import stats

    torch.manual_seed(0)
    tensors = [torch.randn(1000), torch.randn(3, 7).double(), torch.empty(0), torch.randn(5).half(),
               torch.tensor([1.0, math.nan, -2.0]), torch.randn(200) * 1e-3,
               torch.tensor([60000.0, -1.0, 3.0], dtype=torch.half), torch.tensor([3e38, -1e38])]
    chunk = stats._STATS_CHUNK_BYTES
    for limit in (chunk, 64):  # fused chunks, and every tensor over the limit measured on its own
        stats._STATS_CHUNK_BYTES = limit
        try:
            sums, maxes, mins = stats.sums_and_extremes(tensors, torch.device("cpu"))
        finally:
            stats._STATS_CHUNK_BYTES = chunk
        for i, t in enumerate(tensors):
            d = t.double()
            ref = (float(d.sum()), float(d.abs().max()) if t.numel() else -math.inf,
                   float(d.abs().min()) if t.numel() else math.inf)
            for got, want in zip((float(sums[i]), float(maxes[i]), float(mins[i])), ref):
                if math.isnan(want):
                    assert math.isnan(got), (limit, i)
                else:
                    assert got == want or math.isclose(got, want, rel_tol=1e-6), (limit, i, got, want)
