"""The built-in rules and the agent's spike guard on healthy workloads whose gradient norm moves in
ways a spike detector can misread: no finding of a rule that acts, no incident, no change of the
run's desired state, no step skipped by the guard.

- A diffusion model (epsilon prediction, timesteps drawn per sample): its gradient norm climbs
  more than 10x over its first 40 steps while its loss falls, never 2x from one step to the next.
  Judged against the median alone, the guard skipped 16 steps in a row as soon as it armed and
  the rules cut the LR to 0.1x.
- A multitask model whose second task (a regression) comes every 5th step with a gradient norm
  4-7x the first task's (a classification). The guard skipped every one of those steps, one at a
  time, and the second task stopped learning; the rules opened incidents that climbed to a pause.

Each run trains for real on the CPU with the agent attached (``report_every`` 1 and 10, the spike
guard on) and its reports are replayed through the default rules with the controller's recovery
logic (``engine.simulate``), as ``test_service_rules_schedules.py`` does.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainer_agent as ta
from tests.service.report_replay import acting, replay, train

STEPS = 240
SKIPPED = 'trainguard_skipped_steps_total{reason="spike"}'


def _mlp(*sizes: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b), nn.SiLU()]
    return nn.Sequential(*layers[:-1])


def _diffusion(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[int], tuple[torch.Tensor, str]]]:
    """A small MLP denoiser of 8x8 binary images, DDPM's linear schedule over 1,000 steps."""
    g = torch.Generator().manual_seed(1234)
    images = torch.randn(10, 64, generator=g).sign()
    alpha_bar = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000), 0)

    class Denoiser(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.time = _mlp(32, 128, 128)
            self.net = _mlp(64 + 128, 256, 256, 64)

        def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            angles = t[:, None].float() * torch.exp(-math.log(10000) * torch.arange(16) / 16)[None]
            return self.net(torch.cat([x, self.time(torch.cat([angles.sin(), angles.cos()], 1))], 1))

    torch.manual_seed(seed)
    model = Denoiser()
    data = torch.Generator().manual_seed(seed + 99)

    def loss(k: int) -> tuple[torch.Tensor, str]:
        x0 = images[torch.randint(0, 10, (64,), generator=data)] + 0.1 * torch.randn(64, 64, generator=data)
        t = torch.randint(0, 1000, (64,), generator=data)
        noise = torch.randn(64, 64, generator=data)
        ab = alpha_bar[t][:, None]
        return F.mse_loss(model(ab.sqrt() * x0 + (1 - ab).sqrt() * noise, t), noise), "denoise"

    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0), loss


def _multitask(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[int], tuple[torch.Tensor, str]]]:
    """A shared trunk, a 10-way classification head, and a regression head trained every 5th step."""
    g = torch.Generator().manual_seed(1234)
    wa, wb = torch.randn(32, 10, generator=g), torch.randn(32, 4, generator=g)
    torch.manual_seed(seed)
    model = nn.ModuleDict({"trunk": _mlp(32, 128, 128), "a": nn.Linear(128, 10), "b": nn.Linear(128, 4)})
    data = torch.Generator().manual_seed(seed + 99)

    def loss(k: int) -> tuple[torch.Tensor, str]:
        x = torch.randn(64, 32, generator=data)
        h = F.relu(model["trunk"](x))
        if k % 5 == 4:
            return F.mse_loss(model["b"](h), 6 * torch.tanh(x @ wb / 4)), "b"
        return F.cross_entropy(model["a"](h), (x @ wa).argmax(1)), "a"

    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), loss


def _train(make: Callable[[int], Any], seed: int, every: int) -> tuple[list[dict[str, float]], list[tuple[str, float, float]]]:
    """The agent's reports (one per report step) and, per step, (task, loss, gradient norm)."""
    model, opt, loss_of = make(seed)
    agent = ta.attach(model, opt, job="workload", run="r",
                      config=ta.AgentConfig(metrics_port=None, report_every=every, skip_spikes=True))
    rows, trace = [], []
    for k in range(STEPS):
        loss, task = loss_of(k)
        loss.backward()
        norm = math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters() if p.grad is not None))
        trace.append((task, float(loss), norm))
        opt.step()
        opt.zero_grad()
        agent.end_step(loss.detach())
        if (k + 1) % every == 0:
            rows.append(agent.latest())
    agent.close(1.0)
    return rows, trace


def _quiet(rows: list[dict[str, float]]) -> None:
    steps = replay(rows, "workload")
    assert acting(steps) == []
    assert all(not s.incidents for s in steps)
    assert all(s.desired.lr_scale == 1.0 and s.desired.generation == 0 and not s.desired.paused for s in steps)
    assert rows[-1][SKIPPED] == 0


@pytest.mark.parametrize("every", [1, 10])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_diffusion_models_climbing_gradient_norm_draws_no_action(seed: int, every: int) -> None:
    rows, trace = _train(_diffusion, seed, every)
    norms, losses = [n for _, _, n in trace], [v for _, v, _ in trace]
    assert max(norms[:60]) > 10 * norms[0] and sum(losses[50:60]) < 0.7 * sum(losses[:10])  # climbs, loss falls
    assert max(b / max(norms[max(0, i - 3):i + 1]) for i, b in enumerate(norms[1:])) < 2.0  # never a jump
    _quiet(rows)


@pytest.mark.parametrize("every", [1, 10])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_second_task_every_fifth_step_draws_no_action_and_keeps_learning(seed: int, every: int) -> None:
    rows, trace = _train(_multitask, seed, every)
    a = [n for task, _, n in trace[100:] if task == "a"]
    b = [n for task, _, n in trace[100:] if task == "b"]
    assert statistics.median(b) > 4 * statistics.median(a)  # the second task's norm, a level of its own
    b_losses = [v for task, v, _ in trace if task == "b"]
    assert b_losses[-1] < 0.5 * b_losses[0]  # trained, not skipped
    _quiet(rows)


def _fired(rows: list[dict[str, float]], rule: str) -> list[int]:
    """The steps of the reports on which ``rule`` fired, replayed through the default rules."""
    return [s.step_last for s in replay(rows, "workload") for f in s.fired if f.finding.rule.name == rule]


def _gpt_rows(opt_name: str, lr: float, warmup: int, steps: int) -> tuple[list[dict[str, float]], list[float]]:
    """A byte-level TinyGPT trained on the standard library's source, batches of 8: the agent's
    report after every step and, per step, ||W_after - W_before|| / ||W_before|| measured here."""
    from trainguard.demo.model import ByteCorpus, TinyGPT, next_byte_loss, stdlib_source_bytes
    corpus = ByteCorpus(stdlib_source_bytes(1 << 20), seq_len=64, batch_size=8, seed=0)
    torch.manual_seed(0)
    model = TinyGPT(seq_len=64, d_model=64, n_layers=2, n_heads=4)
    opt = (torch.optim.Adam(model.parameters(), lr=lr) if opt_name == "adam"
           else torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
    agent = ta.attach(model, opt, job="workload", run="r", lr_scheduler=sched,
                      config=ta.AgentConfig(metrics_port=None, report_every=1))
    weights: list[torch.Tensor] = []

    def loss_of(k: int) -> torch.Tensor:  # also keeps the weights each step starts from
        weights.append(torch.cat([p.detach().flatten().clone() for p in model.parameters()]))
        return next_byte_loss(model, *corpus.batch(k, 0))

    rows = train(agent, opt, loss_of, steps + 1, sched)[:-1]
    return rows, [float((b - a).norm() / a.norm()) for a, b in zip(weights, weights[1:])]


@pytest.mark.parametrize("opt_name, warmup", [("adam", 0), ("adamw", 0), ("adamw", 20)])
def test_adams_first_steps_at_a_sane_lr_draw_no_update_ratio_alert(opt_name: str, warmup: int) -> None:
    rows, ratios = _gpt_rows(opt_name, 1e-3, warmup, 90)
    if not warmup:  # bias correction: the first updates are about the LR in every element, above 1 %
        assert min(ratios[:3]) > 0.01 and max(ratios[40:]) < 0.01
    assert _fired(rows, "update_ratio_high") == []


@pytest.mark.parametrize("lr", [1e-2, 1e-1])
def test_an_lr_10_to_100_times_too_high_draws_the_update_ratio_alert_on_adams_first_steps(lr: float) -> None:
    rows, ratios = _gpt_rows("adamw", lr, 0, 20)
    first = _fired(rows, "update_ratio_high")
    assert first and first[0] == 3  # the first three reports, above the first steps' limit (0.04)
    assert min(ratios[:3]) > 0.04


@pytest.fixture(scope="module")
def trained_gpt() -> dict[str, Any]:
    """A byte-level TinyGPT trained 100 steps with AdamW at 2e-3 (``_gpt_rows``'s data), as a
    checkpoint would hold it: the model's, the optimizer's and the agent's states."""
    from trainguard.demo.model import ByteCorpus, TinyGPT, next_byte_loss, stdlib_source_bytes
    corpus = ByteCorpus(stdlib_source_bytes(1 << 20), seq_len=64, batch_size=8, seed=0)
    torch.manual_seed(0)
    model = TinyGPT(seq_len=64, d_model=64, n_layers=2, n_heads=4)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    agent = ta.attach(model, opt, job="workload", run="r", config=ta.AgentConfig(metrics_port=None, report_every=1))
    rows = train(agent, opt, lambda k: next_byte_loss(model, *corpus.batch(k, 0)), 100)
    return {"rows": rows, "model": model.state_dict(), "optimizer": opt.state_dict(), "agent": agent.state_dict(),
            "corpus": corpus}


def _resumed_rows(saved: dict[str, Any], lr: float, optimizer_state: bool, agent_state: bool,
                  steps: int) -> tuple[list[dict[str, float]], list[float]]:
    """``saved`` resumed in new objects: the model loaded, a new AdamW at ``lr`` (its state loaded
    from the checkpoint or not), a new agent (its state loaded or not: the run's step goes on or
    restarts), trained ``steps`` steps on the batches after the checkpoint's. The agent's report
    after every step and, per step, ||W_after - W_before|| / ||W_before|| measured here."""
    from trainguard.demo.model import TinyGPT, next_byte_loss
    model = TinyGPT(seq_len=64, d_model=64, n_layers=2, n_heads=4)
    model.load_state_dict(saved["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    if optimizer_state:
        opt.load_state_dict(saved["optimizer"])
        for group in opt.param_groups:
            group["lr"] = lr
    agent = ta.attach(model, opt, job="workload", run="r", config=ta.AgentConfig(metrics_port=None, report_every=1))
    if agent_state:
        agent.load_state_dict(saved["agent"])
    weights: list[torch.Tensor] = []

    def loss_of(k: int) -> torch.Tensor:
        weights.append(torch.cat([p.detach().flatten().clone() for p in model.parameters()]))
        return next_byte_loss(model, *saved["corpus"].batch(100 + k, 0))

    rows = train(agent, opt, loss_of, steps + 1)[:-1]
    return rows, [float((b - a).norm() / a.norm()) for a, b in zip(weights, weights[1:])]


def test_a_run_resumed_with_a_fresh_optimizer_state_draws_no_update_ratio_alert(trained_gpt: dict[str, Any]) -> None:
    """The checkpoint holds the model and the agent, not the optimizer: AdamW starts afresh at
    step 101, and its first updates are about the LR in every element (above 1 %, three times the
    run's ratio before), for its first steps as for a run's."""
    before = trained_gpt["rows"]
    rows, ratios = _resumed_rows(trained_gpt, 2e-3, optimizer_state=False, agent_state=True, steps=60)
    assert [r["trainguard_step"] for r in rows[:2]] == [101.0, 102.0]  # the run's step goes on
    assert max(r["trainguard_update_ratio"] for r in before[-10:]) < 0.01 < min(ratios[:3])
    assert max(ratios[50:]) < 0.01  # settled
    assert _fired(before + rows, "update_ratio_high") == []


@pytest.mark.parametrize("agent_state", [True, False], ids=["step-goes-on", "step-restarts"])
def test_a_run_resumed_with_its_optimizer_state_is_judged_at_the_later_limit_at_once(
        trained_gpt: dict[str, Any], agent_state: bool) -> None:
    """The checkpoint holds the optimizer's state too, and the run resumes at 3 times its LR: the
    updates are 1-4 % of the weights from the first step on, above the 1 % of a settled state
    however young the run's step count (a fine-tune that restarts it), and the rule fires on the
    third report after the resume."""
    rows, ratios = _resumed_rows(trained_gpt, 6e-3, optimizer_state=True, agent_state=agent_state, steps=6)
    assert 0.01 < min(ratios[:3]) and max(ratios[:3]) < 0.04
    first = 101 if agent_state else 1
    assert [r["trainguard_step"] for r in rows[:2]] == [first, first + 1]
    assert _fired(rows, "update_ratio_high")[:1] == [first + 2]


def _mlp_rows(bs: int, lr: float, labels: str, steps: int) -> list[dict[str, float]]:
    """A 32-128-128-10 MLP trained with AdamW on a linear teacher's classes (``labels`` "teacher")
    or on random classes (nothing to learn): the agent's report after every step."""
    g = torch.Generator().manual_seed(1234)
    teacher = torch.randn(32, 10, generator=g)
    torch.manual_seed(0)
    model = _mlp(32, 128, 128, 10)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    agent = ta.attach(model, opt, job="workload", run="r", config=ta.AgentConfig(metrics_port=None, report_every=1))

    def loss_of(k: int) -> torch.Tensor:
        x = torch.randn(bs, 32, generator=g)
        y = (x @ teacher).argmax(1) if labels == "teacher" else torch.randint(0, 10, (bs,), generator=g)
        return F.cross_entropy(model(x), y)

    return train(agent, opt, loss_of, steps)


@pytest.mark.parametrize("bs", [4, 32])
def test_a_learning_run_noisy_or_converged_draws_no_plateau_alert(bs: int) -> None:
    rows = _mlp_rows(bs, 1e-3, "teacher", 600)
    losses = [r["trainguard_loss"] for r in rows]
    assert statistics.fmean(losses[-50:]) < 0.5 * statistics.fmean(losses[:10])  # it learned
    late = np.arange(100)
    assert np.polyfit(late, losses[-100:], 1)[0] > -5e-4  # and is flat by its end: a plateau
    assert _fired(rows, "loss_not_decreasing") == []


@pytest.mark.parametrize("labels, lr", [("random", 1e-3), ("teacher", 1e-7)])
def test_a_run_that_never_learns_draws_the_plateau_alert(labels: str, lr: float) -> None:
    rows = _mlp_rows(32, lr, labels, 200)
    losses = [r["trainguard_loss"] for r in rows]
    assert abs(statistics.fmean(losses[-50:]) - statistics.fmean(losses[:50])) < 0.05 * statistics.fmean(losses[:50])
    first = _fired(rows, "loss_not_decreasing")
    assert first and first[0] < 200  # within the run's first 200 steps (at its 100th report or soon after)

