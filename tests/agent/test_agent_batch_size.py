"""The agent's recommended batch size follows the gradient noise scale on a problem where the
true noise scale is known: per-sample loss 0.5 ||w - x||^2 with x ~ N(mu, sigma^2 I_d), so the
per-sample gradient is w - x, G = w - mu, tr(Sigma) = d sigma^2 and B_noise = d sigma^2 / |w - mu|^2
(in samples). The weights are held fixed (lr = 0), so the true value is exact at every step."""

from __future__ import annotations

import math

import numpy as np
import torch

import trainer_agent as ta

D, SIGMA, MICRO, ACCUM = 32, 1.0, 8, 8


def _run(agent: ta.Agent, w: torch.nn.Parameter, opt: torch.optim.Optimizer, mu: torch.Tensor,
         steps: int, gen: torch.Generator) -> list[float]:
    recommended = []
    for _ in range(steps):
        for _ in range(ACCUM):
            x = mu + SIGMA * torch.randn(MICRO, D, generator=gen, dtype=torch.float64)
            loss = 0.5 * ((w - x) ** 2).sum(dim=1).mean() / ACCUM
            loss.backward()
        opt.step()
        opt.zero_grad()
        agent.end_step(loss.detach(), tokens=MICRO * ACCUM)  # tokens = samples: B in samples
        recommended.append(agent.latest().get("trainguard_recommended_batch_size", math.nan))
    return recommended


def test_recommended_batch_size_follows_the_true_noise_scale() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.zeros(D, dtype=torch.float64))
    model = torch.nn.Module()
    model.w = w
    opt = torch.optim.SGD([w], lr=0.0)
    agent = ta.attach(model, opt, job="noise", run="noise-1", config=ta.AgentConfig(report_every=1))
    try:
        true_b = []
        series = []
        for target in (64.0, 256.0, 32.0):
            # |w - mu|^2 = d sigma^2 / B  ->  mu along the first axis
            mu = torch.zeros(D, dtype=torch.float64)
            mu[0] = math.sqrt(D * SIGMA**2 / target)
            series.append(_run(agent, w, opt, mu, 200, gen))
            true_b.append(target)
        medians = []
        n = MICRO * ACCUM
        n_eff = (1 + 0.95) / (1 - 0.95)  # samples in an exponential moving average of decay 0.95
        for target, rec in zip(true_b, series):
            tail = np.array(rec[100:])  # after 5 time constants of the moving averages
            # The estimate is limited by the error of |G|^2 (the numerator tr(Sigma) is the easy
            # part): for a Gaussian x, one step's unbiased |G|^2 estimate from n samples has
            # variance 2 d sigma^4 / n^2 + 4 |G|^2 sigma^2 / n; the average divides it by n_eff.
            g2 = D * SIGMA**2 / target
            rel_sd = math.sqrt((2 * D * SIGMA**4 / n**2 + 4 * g2 * SIGMA**2 / n) / n_eff) / g2
            medians.append(float(np.median(tail)))
            assert abs(medians[-1] / target - 1) < 3 * rel_sd, (target, medians[-1], rel_sd)
        # it follows the changes of the true noise scale: x4, then /8
        assert medians[1] / medians[0] > 2.0 and medians[1] / medians[2] > 4.0, medians
        # and the agent's current global batch size is reported next to it, in the same unit
        assert agent.latest()["trainguard_global_batch_size"] == MICRO * ACCUM
    finally:
        agent.close()
