"""The built-in rules on the reports of healthy runs whose LR follows a real schedule: no finding of
a rule that acts, no incident, no change of the run's desired state, no step skipped by the agent.
And the LR faults of the user's own schedule still found and corrected.

Each sequence is made here: a small byte-level GPT trained on CPU with AdamW, the real PyTorch or
Hugging Face scheduler, the agent attached (without a controller: its reports are read with
``Agent.latest()`` after every step, ``report_every=1``, the spike guard on), and the reports
replayed through the default rules with the controller's recovery logic (``engine.simulate``).
A float16 run with a GradScaler that skips steps on overflow draws no action either, with its
scaler passed to ``attach`` or not, nor a loss summed over thousands of tokens (gradient norms
above 1e3 from the first step), nor a warm-up stepped once per epoch (torchvision's recipes: the LR
rises 20.8x at the first epoch boundary), nor the warm restarts of a run trained close to zero loss
(its loss and gradient norm jump hundreds of times at each restart).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

import trainer_agent as ta
from tests.service.report_replay import RULES, acting, replay
from trainguard.demo.model import ByteCorpus, TinyGPT, next_byte_loss, stdlib_source_bytes
from trainguard.protocol.wire import Report

transformers_optimization = pytest.importorskip("transformers.optimization")

LR = 2e-3
STEPS = 240
CORPUS = ByteCorpus(stdlib_source_bytes(1 << 18), seq_len=32, batch_size=8)
S = torch.optim.lr_scheduler


def _warm_restarts(opt: torch.optim.Optimizer, steps: int) -> Any:
    # The case: a 20-step linear warm-up, then cosine with warm restarts every 60 steps.
    return S.SequentialLR(opt, [S.LinearLR(opt, start_factor=0.05, total_iters=20),
                                S.CosineAnnealingWarmRestarts(opt, T_0=60, eta_min=1e-5)], milestones=[20])


class PerEpoch:
    """A scheduler stepped once per epoch of ``EPOCH`` steps, as torchvision's reference recipes
    step theirs (the loop calls ``step()`` after every optimizer step)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0

    def step(self) -> None:
        self.calls += 1
        if self.calls % EPOCH == 0:
            self.inner.step()

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "calls": self.calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
        self.calls = state["calls"]


EPOCH = 30


def _per_epoch_warmup(opt: torch.optim.Optimizer, steps: int) -> Any:
    # torchvision's recipe: a linear warm-up from 1 % over 5 epochs, then cosine, stepped per epoch:
    # the LR rises 20.8x at the first epoch boundary
    epochs = steps // EPOCH
    return PerEpoch(S.SequentialLR(opt, [S.LinearLR(opt, start_factor=0.01, total_iters=5),
                                         S.CosineAnnealingLR(opt, T_max=epochs - 5)], milestones=[5]))


def _per_epoch_constant_warmup(opt: torch.optim.Optimizer, steps: int) -> Any:
    # torchvision's "constant" warm-up: 10 % for 3 epochs, then the full LR (a 10x step), decaying
    return PerEpoch(S.SequentialLR(opt, [S.ConstantLR(opt, factor=0.1, total_iters=3), S.ExponentialLR(opt, 0.8)],
                                   milestones=[3]))


def _wsd(opt: torch.optim.Optimizer, steps: int) -> Any:
    return transformers_optimization.get_wsd_schedule(opt, num_warmup_steps=20, num_decay_steps=steps // 5,
                                                      num_stable_steps=steps - 20 - steps // 5)


SCHEDULES: dict[str, Callable[[torch.optim.Optimizer, int], Any]] = {
    "linear_warmup": lambda opt, steps: S.LinearLR(opt, start_factor=1e-3, total_iters=50),
    "cosine": lambda opt, steps: transformers_optimization.get_cosine_schedule_with_warmup(opt, 20, steps),
    "warm_restarts": _warm_restarts,
    "hf_cosine_with_restarts": lambda opt, steps: transformers_optimization.get_scheduler(
        "cosine_with_restarts", opt, num_warmup_steps=10, num_training_steps=steps,
        scheduler_specific_kwargs={"num_cycles": 3}),
    "onecycle": lambda opt, steps: S.OneCycleLR(opt, max_lr=LR, total_steps=steps),
    "wsd": _wsd,
    "step_decay": lambda opt, steps: S.StepLR(opt, step_size=60, gamma=0.3),
    "linear_decay": lambda opt, steps: S.LinearLR(opt, start_factor=1.0, end_factor=0.01, total_iters=steps),
    "cyclic_triangular": lambda opt, steps: S.CyclicLR(opt, base_lr=LR / 10, max_lr=LR, step_size_up=30,
                                                       cycle_momentum=False),
    "per_epoch_warmup": _per_epoch_warmup,
    "per_epoch_constant_warmup": _per_epoch_constant_warmup,
}


def _train(schedule: Callable[[torch.optim.Optimizer, int], Any], steps: int, *, seed: int = 0,
           state: dict[str, Any] | None = None, first_step: int = 0,
           loss_scale: float = 1.0) -> tuple[list[dict[str, float]], dict[str, Any]]:
    """The agent's report after every step of a run, and the run's state at its end. ``loss_scale``:
    the loss is the mean times this (a loss summed over that many tokens)."""
    torch.manual_seed(seed)
    model = TinyGPT(seq_len=32, d_model=32, n_layers=1, n_heads=2)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        for g in opt.param_groups:
            g["lr"] = g["initial_lr"] = LR  # the resumed run builds its own schedule afresh
    sched = schedule(opt, steps)
    agent = ta.attach(model, opt, job="schedules", run="r", lr_scheduler=sched,
                      config=ta.AgentConfig(metrics_port=None, report_every=1, skip_spikes=True))
    if state is not None:  # the agent's counters and the schedule's envelope; the new schedule starts afresh
        agent.load_state_dict({k: v for k, v in state["agent"].items() if k != "lr_scheduler"})
    rows = []
    for k in range(steps):
        ids, mask = CORPUS.batch(first_step + k + seed * 100_000, 0)
        loss = next_byte_loss(model, ids, mask) * loss_scale
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        agent.end_step(loss.detach())
        rows.append(agent.latest())
    end = {"model": model.state_dict(), "optimizer": opt.state_dict(), "agent": agent.state_dict()}
    agent.close(1.0)
    return rows, end


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_a_healthy_schedule_draws_no_finding_and_no_action(name: str) -> None:
    rows, _ = _train(SCHEDULES[name], STEPS)
    lrs = [v["trainguard_scheduler_lr"] for v in rows]
    # the sequences are what they say: the LR the schedule set rises and falls as planned
    assert max(lrs) == pytest.approx(LR, rel=0.02)
    if name in ("warm_restarts", "hf_cosine_with_restarts"):
        assert sum(1 for a, b in zip(lrs, lrs[1:]) if b > 20 * a) >= 2  # at least two restarts, each a >20x jump
    if name == "cyclic_triangular":  # several cycles, each a 10x rise from the base LR to the peak and back
        assert sum(1 for a, b, c in zip(lrs, lrs[1:], lrs[2:]) if b > a and b > c) >= 3
    if name.startswith("per_epoch"):  # the warm-up's step at an epoch boundary, 20.8x or 10x
        assert max(b / a for a, b in zip(lrs, lrs[1:])) == pytest.approx(20.8 if name == "per_epoch_warmup" else 10.0)
    steps = replay(rows, "schedules")
    assert acting(steps) == []
    assert all(s.desired.lr_scale == 1.0 and s.desired.generation == 0 for s in steps)
    assert all(v.get("trainguard_consecutive_skipped_steps", 0) == 0 for v in rows)  # the spike guard skipped nothing


def test_a_loss_summed_over_tokens_draws_no_action() -> None:
    # reduction="sum" over 4,096 tokens: gradient norms in the thousands from the first step, the
    # run's scale (AdamW's update does not depend on it), not an explosion an LR cut would answer
    rows, _ = _train(SCHEDULES["cosine"], STEPS, loss_scale=4096.0)
    norms = [v["trainguard_grad_norm"] for v in rows]
    assert min(norms) > 1e3 and norms[0] > 5e3
    steps = replay(rows, "schedules")
    assert acting(steps) == []
    assert all(s.desired.lr_scale == 1.0 and s.desired.generation == 0 for s in steps)
    assert rows[-1]["trainguard_loss"] / 4096 < 0.8 * rows[0]["trainguard_loss"] / 4096  # and it learns


def test_a_rewarm_after_resume_draws_no_finding_and_no_action() -> None:
    # 120 steps of cosine decay, then the run resumes from its checkpoint (model, optimizer and the
    # agent's state) and its new schedule warms up again from 1 % of the LR.
    first, state = _train(SCHEDULES["cosine"], 120)
    rewarm = lambda opt, steps: S.LambdaLR(opt, lambda k: min(1.0, 0.01 + k / 30))  # noqa: E731
    second, _ = _train(rewarm, 120, state=state, first_step=120)
    assert second[0]["trainguard_step"] == 121.0
    assert second[0]["trainguard_scheduler_lr"] < 0.05 * first[60]["trainguard_scheduler_lr"]
    steps = replay(first + second, "schedules")
    assert acting(steps) == []
    assert all(s.desired.lr_scale == 1.0 and s.desired.generation == 0 for s in steps)


def test_warm_restarts_of_a_run_trained_to_near_zero_loss_draw_no_action() -> None:
    # A small regression trained to interpolation (loss ~1e-8) with CosineAnnealingWarmRestarts:
    # each restart throws it out of its minimum, and its loss, gradient norm and update per unit of
    # LR jump by hundreds of times, far beyond the spike rules' discount for the LR's rise. The
    # gradient norm climbs there 1.6x per step for 15 steps (300x in all): a climb, which the
    # agent's spike guard takes (it skipped them when it judged against the median alone). The
    # cause is the schedule's own move, within the range it already had: no incident opens, nothing
    # is cut, rolled back or paused.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = S.CosineAnnealingWarmRestarts(opt, T_0=200)
    agent = ta.attach(model, opt, job="schedules", run="r", lr_scheduler=sched,
                      config=ta.AgentConfig(metrics_port=None, report_every=10, skip_spikes=True))
    x, y = torch.randn(32, 16), torch.randn(32, 1)
    rows = []
    for _ in range(2200):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        agent.end_step(loss.detach())
        if agent.latest().get("trainguard_step", 0) > (rows[-1]["trainguard_step"] if rows else 0):
            rows.append(agent.latest())
    agent.close(1.0)
    assert min(v["trainguard_loss"] for v in rows[180:200]) < 1e-7  # trained close to zero loss
    steps = replay(rows, "schedules")
    fired = {a.split()[1] for a in acting(steps) if int(a.split()[0]) > 2000}
    assert {"grad_norm_spike:", "loss_spike:"} <= fired  # the restart's jumps are there, and seen
    skipped = 'trainguard_skipped_steps_total{reason="spike"}'
    assert rows[-1][skipped] == 0  # climbs, taken by the guard
    assert all(s.desired.lr_scale == 1.0 and s.desired.generation == 0 for s in steps)


def _loss_window(lrs: list[float], losses: list[float]) -> Any:
    """A window of reports with the given scheduled LRs and losses, and the agent's envelope."""
    from trainguard.service.window import RunWindow

    w = RunWindow(capacity=128, rank_capacity=8, world_size=1, created=0.0)
    peak = None
    for i, (lr, loss) in enumerate(zip(lrs, losses)):
        values = {"trainguard_loss": loss, "trainguard_scheduler_lr": lr, "trainguard_scheduler_lr_max": lr}
        if peak is not None:
            values["trainguard_scheduler_lr_peak"] = peak
        w.append(Report(job="j", step_first=i + 1, step_last=i + 1, time=float(i), values=values), float(i))
        peak = lr if peak is None else max(peak, lr)
    return w


def test_the_loss_spike_discount_follows_planned_rises_only() -> None:
    from trainguard.service.evaluate import evaluate

    rule = next(r for r in RULES.base if r.name == "loss_spike")
    assert rule.schedule_discount
    noise = [2.0 + 0.01 * ((7 * i) % 5) for i in range(70)]
    # A restart: the LR decayed from the peak 1e-3 it had before the window to 1e-5, then back.
    restart = [1e-3] * 5 + [1e-5] * 64 + [1e-3]
    # A fault: the LR was 1e-3 all along and jumps to 1 (the agent's own peak follows the jump).
    fault = [1e-3] * 65 + [1.0] * 5
    bumped = noise[:-1] + [2.5]  # the newest loss far above its window
    assert evaluate((rule,), _loss_window([1e-3] * 70, bumped), 70.0)[0].active  # no LR change: a spike
    assert not evaluate((rule,), _loss_window(restart, bumped), 70.0)[0].active  # a planned rise: discounted
    found = evaluate((rule,), _loss_window(fault, bumped), 70.0)[0]
    assert found.active and "schedule_lr_rise" not in found.values  # above the envelope: not discounted


def _train_float16(passed: bool, overflow: range) -> tuple[list[dict[str, float]], list[float], float]:
    """A float16 run (autocast) with a GradScaler that doubles its scale every 20 steps, passed to
    attach or not; the loss itself overflows on the steps (0-based) of ``overflow``. Its reports,
    the scale before each step and the scale at the end."""
    torch.manual_seed(0)
    model = TinyGPT(seq_len=32, d_model=32, n_layers=1, n_heads=2)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cpu", growth_interval=20)
    agent = ta.attach(model, opt, job="schedules", run="r", scaler=scaler if passed else None,
                      config=ta.AgentConfig(metrics_port=None, report_every=1, skip_spikes=True))
    rows, scales = [], []
    for k in range(STEPS):
        ids, mask = CORPUS.batch(k, 0)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = next_byte_loss(model, ids, mask) * (math.inf if k in overflow else 1.0)
        scaler.scale(loss).backward()
        scales.append(scaler.get_scale())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        agent.end_step(loss.detach())
        rows.append(agent.latest())
    agent.close(1.0)
    return rows, scales, scaler.get_scale()


def _incidents(steps: list[Any]) -> list[tuple[int, str, list[str]]]:
    """(onset step, outcome, rungs) of every incident, as the last report left it."""
    last = {i["id"]: i for s in steps for i in s.incidents}
    return [(i["onset_step"], i["outcome"], [r["rung"] for r in i["rungs"]]) for i in last.values()]


@pytest.mark.parametrize("passed", [True, False], ids=["scaler_passed", "scaler_not_passed"])
def test_a_float16_run_with_its_grad_scalers_skips_draws_no_action(passed: bool) -> None:
    # A healthy run whose scaler skips a step on each overflow of its scaled gradients. Not passed
    # to attach, the scaler is found at its first step, whose gradients carry a scale of 2^16:
    # measured scaled, they read as a norm ~1e5. At step 101 the loss itself overflows once: the
    # scaler skips that step too, so the weights are as they were, and the rollback the non-finite
    # loss asks for is not taken; the incident stays at its first rung, the step not taken.
    rows, scales, last = _train_float16(passed, range(100, 101))
    skipped = sum(1 for a, b in zip(scales, scales[1:] + [last]) if b < a)
    assert skipped >= 3  # the scaler backed off (and skipped the step) several times
    assert rows[-1]["trainguard_amp_skipped_steps_total"] == skipped
    assert max(v["trainguard_grad_norm"] for v in rows if math.isfinite(v["trainguard_grad_norm"])) < 100
    assert not math.isfinite(rows[100]["trainguard_loss"]) and scales[101] == scales[100] / 2
    steps = replay(rows, "schedules")
    assert acting(steps) == ["101 loss_nonfinite: non-finite trainguard_loss"]
    assert all(s.desired.lr_scale == 1.0 and s.desired.generation == 0 and s.desired.rollback_seq == 0 for s in steps)
    assert _incidents(steps) == [(101, "recovered", ["skip"])]
    assert all(v.get("trainguard_consecutive_skipped_steps", 0) == 0 for v in rows)


def test_a_float16_run_summed_over_tokens_whose_first_step_overflows_draws_no_action() -> None:
    """float16 with a GradScaler at its default scale 2^16 and a loss summed over 4,096 tokens,
    a report every 10 steps: the scaled loss overflows at step 1, which the scaler skips, and
    the unscaled gradient norms are in the thousands from the first step taken on (the run's
    scale, left alone by ``grad_norm_high``'s ``crossing_window``). The scaler halves its scale
    until step 12; the reports at steps 1 and 10 hold no finite norm, and the agent reports their
    largest as 0 (its interval's rows not written since the last report). A 0 read as a norm
    within 1e3 made the report at step 20 a crossing: the LR was halved, the ladder climbed, and
    without a snapshot the run was paused."""
    torch.manual_seed(0)
    model = TinyGPT(seq_len=32, d_model=32, n_layers=1, n_heads=2)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cpu")
    agent = ta.attach(model, opt, job="schedules", run="r", scaler=scaler,
                      config=ta.AgentConfig(metrics_port=None, report_every=10, skip_spikes=True))
    rows: list[dict[str, float]] = []
    for k in range(100):
        ids, mask = CORPUS.batch(k, 0)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = next_byte_loss(model, ids, mask) * 4096.0
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        agent.end_step(loss.detach())
        if not rows or agent.latest()["trainguard_step"] != rows[-1]["trainguard_step"]:
            rows.append(agent.latest())
    agent.close(1.0)
    assert [v["trainguard_step"] for v in rows] == [1.0] + [float(k) for k in range(10, 101, 10)]
    # the scaler skips steps 1-12 (each an overflow): the reports at steps 1 and 10 hold no finite norm
    assert rows[-1]["trainguard_amp_skipped_steps_total"] >= 10
    assert not any(math.isfinite(v["trainguard_grad_norm"]) or v["trainguard_grad_norm_max"] > 0 for v in rows[:2])
    assert min(v["trainguard_grad_norm_max"] for v in rows[2:]) > 1e3
    steps = replay(rows, "schedules")
    assert acting(steps) == []
    assert all(s.desired.lr_scale == 1.0 and s.desired.generation == 0 and not s.incidents for s in steps)


def test_a_float16_run_whose_loss_keeps_overflowing_climbs_the_ladder() -> None:
    # The loss overflows on every step from step 101 on: the scaler skips them all, the weights stay
    # as they were, but the signals do not come back, and the ladder goes on from its first rung
    # (without a snapshot to roll back to: paused for a human).
    rows, _, _ = _train_float16(False, range(100, STEPS))
    steps = replay(rows, "schedules")
    (onset, outcome, rungs), = _incidents(steps)
    assert onset == 101 and outcome == "escalated" and rungs[0] == "skip" and len(rungs) > 1
    assert steps[-1].desired.paused


@pytest.mark.parametrize("climbs", [True, False], ids=["climbs-taken", "median-alone"])
def test_a_brief_instability_at_a_cyclic_peak_recovers_without_a_pause(climbs: bool) -> None:
    """Adam under CyclicLR (triangular2, 1e-4 to 1e-2, a report every 10 steps): near the first
    peak the gradient norm goes 10x for ~15 steps. The spike guard skips its two jumps (2.5-2.8x
    the steps before) and takes the rest, which climbs: no incident opens (``climbs-taken``, the
    defaults). Judged against the median alone (``median-alone``: the guard's ``min_jump`` 1) the
    guard skips ~15 steps in a row, an incident. Then the run trains on, its loss below where it
    was, its update per unit of LR a quarter of the first reports' (Adam's normalised step falls
    on its own as training goes on). The signals are back: the incident recovers at its first
    rung, with no LR cut and no pause. Judged by the update per unit of LR alone, the run read as
    degraded and was paused at step 150, its loss falling."""
    torch.manual_seed(0)
    model = TinyGPT(seq_len=64, d_model=32, n_layers=2, n_heads=2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    sched = S.CyclicLR(opt, base_lr=1e-4, max_lr=1e-2, step_size_up=100, mode="triangular2", cycle_momentum=False)
    agent = ta.attach(model, opt, job="cyclic", run="r", lr_scheduler=sched,
                      config=ta.AgentConfig(metrics_port=None, report_every=10, skip_spikes=True))
    if not climbs:
        guard = agent.control.skip.guard
        guard.config = dataclasses.replace(guard.config, min_jump=1.0)
    corpus = ByteCorpus(stdlib_source_bytes(1 << 19), seq_len=32, batch_size=8)
    rows = []
    for k in range(200):
        ids, mask = corpus.batch(k, 0)
        loss = next_byte_loss(model, ids, mask)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        agent.end_step(loss.detach(), tokens=ids.numel())
        if (k + 1) % 10 == 0:
            rows.append(agent.latest())
    agent.close(1.0)
    skipped = rows[-1]['trainguard_skipped_steps_total{reason="spike"}']
    assert skipped == 2 if climbs else skipped >= 10  # the instability's jumps, or all of it, skipped
    steps = replay(rows, "cyclic")
    incidents = _incidents(steps)
    assert [rungs for _, _, rungs in incidents] == ([] if climbs else [["skip"]]), incidents
    assert all(s.desired.lr_scale == 1.0 and not s.desired.paused for s in steps)
