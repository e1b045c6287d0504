"""The evaluation of the built-in rules that read one metric (``service/evaluate_metrics.py``) on
the reports of real training runs whose values cross a rule's line in healthy operation: float16
with a GradScaler that backs off (``grad_nonfinite``), a gradient norm whose own level is near 1e3
(``grad_norm_high``). Each run trains a small model on the CPU with the agent attached (a report
every step, without a controller: ``Agent.latest()``), and its reports are replayed through the
default rules with the controller's recovery logic (``engine.simulate``); the same runs with a
fault injected show the rule still finds it."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import trainer_agent as ta
from tests.service.report_replay import replay, train
from trainguard.demo.model import ByteCorpus, TinyGPT, next_byte_loss, stdlib_source_bytes

CORPUS = ByteCorpus(stdlib_source_bytes(1 << 18), seq_len=32, batch_size=8)


def _findings(steps: list[Any], rule: str) -> list[int]:
    """The steps of the reports on which ``rule`` found something (alerted, or held back by its cooldown)."""
    return [s.step_last for s in steps for f in [a.finding for a in s.fired] + [f for f, _ in s.suppressed]
            if f.rule.name == rule]


def _float16_rows(scaler: bool, bad_steps: range = range(0)) -> tuple[list[dict[str, float]], list[float]]:
    """A TinyGPT trained 260 steps with AdamW at 2e-3 under float16 autocast, with a GradScaler
    that doubles its scale after 20 steps without an overflow (``scaler``), or without one; on the
    steps (1-based) of ``bad_steps`` the final norm's weight gets an infinite gradient in the
    backward pass (a layer that overflows). The reports, and the loss scale after each step."""
    torch.manual_seed(0)
    model = TinyGPT(seq_len=32, d_model=32, n_layers=1, n_heads=2)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    amp = torch.amp.GradScaler("cpu", growth_interval=20) if scaler else None
    agent = ta.attach(model, opt, job="amp", run="r", scaler=amp,
                      config=ta.AgentConfig(metrics_port=None, report_every=1, skip_spikes=True))
    rows: list[dict[str, float]] = []
    scales: list[float] = []
    model.ln_f.weight.register_hook(lambda g: g * math.inf if len(rows) + 1 in bad_steps else g)
    for k in range(260):
        with torch.autocast("cpu", dtype=torch.float16, enabled=scaler):
            loss = next_byte_loss(model, *CORPUS.batch(k, 0))
        (amp.scale(loss) if amp else loss).backward()
        if amp:
            amp.step(opt)
            amp.update()
            scales.append(amp.get_scale())
        else:
            opt.step()
        opt.zero_grad()
        agent.end_step(loss.detach())
        rows.append(agent.latest())
    agent.close(1.0)
    return rows, scales


def test_a_grad_scalers_back_offs_draw_no_grad_nonfinite_alert() -> None:
    """Each time the scaler has doubled its scale and the scaled gradients overflow, it skips the
    step and halves the scale back: a report with non-finite gradients, every 20-40 steps here
    (every 2,000 steps or so with the default growth_interval). Each was a grad_nonfinite alert."""
    rows, scales = _float16_rows(scaler=True)
    backoffs = [k + 1 for k in range(1, len(scales)) if scales[k] < scales[k - 1]]
    assert len(backoffs) >= 5 and rows[-1]["trainguard_amp_skipped_steps_total"] == len(backoffs)
    assert all(not math.isfinite(rows[k - 1]["trainguard_grad_norm"]) for k in backoffs)
    assert min(scales[100:]) >= min(scales[40:100]) / 2  # the scale holds its level: back-offs, no collapse
    assert _findings(replay(rows, "amp"), "grad_nonfinite") == []


def test_gradients_that_overflow_more_often_than_the_scalers_back_off_are_found() -> None:
    # From step 153 a gradient is infinite every 4th step: the scaler skips each and halves its
    # scale, never doubling it back (20 steps without an overflow are needed), which takes it
    # below its level (its median over the 64 reports before, 2 halvings above it at step 153):
    # every one is found.
    bad = range(153, 261, 4)
    rows, scales = _float16_rows(scaler=True, bad_steps=bad)
    assert scales[-1] <= scales[150] / 2 ** 20
    assert _findings(replay(rows, "amp"), "grad_nonfinite") == list(bad)


def test_a_nonfinite_gradient_without_a_grad_scaler_is_found_at_once() -> None:
    # float32, no scaler: any non-finite gradient is a fault (the optimizer applies it)
    rows, _ = _float16_rows(scaler=False, bad_steps=range(150, 151))
    assert "trainguard_loss_scale" not in rows[149]
    assert _findings(replay(rows, "amp"), "grad_nonfinite")[:1] == [150]


def _summed_rows(weight: float, poison_at: int | None = None) -> list[dict[str, float]]:
    """A byte-level TinyGPT trained 400 steps with AdamW at 2e-3 (warm-up, cosine), its loss the mean
    over the batch's tokens times ``weight`` (a loss summed over that many tokens); at step
    ``poison_at`` (1-based) the loss is weighted 1e4 more (a mis-scaled batch). A report every step."""
    torch.manual_seed(0)
    model = TinyGPT(seq_len=32, d_model=32, n_layers=1, n_heads=2)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: min(1.0, (k + 1) / 20) * 0.5 * (1 + math.cos(math.pi * k / 400)))
    agent = ta.attach(model, opt, job="summed", run="r", lr_scheduler=sched,
                      config=ta.AgentConfig(metrics_port=None, report_every=1, skip_spikes=True))

    def loss_of(k: int) -> torch.Tensor:
        return next_byte_loss(model, *CORPUS.batch(k, 0)) * weight * (1e4 if k + 1 == poison_at else 1.0)

    return train(agent, opt, loss_of, 400, sched)


@pytest.mark.parametrize("weight", [512.0, 1024.0])
def test_a_gradient_norm_that_hovers_around_1e3_draws_no_grad_norm_alert(weight: float) -> None:
    """A loss summed over 512 or 1,024 tokens: the gradient norm's own level is about 1e3, and it
    crosses 1e3 back and forth with its batch-to-batch noise (up to 2.5x its median of the 64
    reports before). Each upward crossing read as a rise: at 512 the second report (1,128 after
    963) halved the LR and the incident climbed to a rollback; at 1,024 the rule alerted again at
    each cooldown's end. A poisoned batch on the same run (x1e4) is still found at its step."""
    rows = _summed_rows(weight)
    norms = [r["trainguard_grad_norm_max"] for r in rows]
    ups = sum(1 for a, b in zip(norms, norms[1:]) if a <= 1e3 < b)
    assert ups >= 10 and min(norms) < 600 and max(norms) > 1400  # it hovers, and crosses 1e3 often
    steps = replay(rows, "summed")
    assert _findings(steps, "grad_norm_high") == []
    assert all(s.desired.lr_scale == 1.0 and s.desired.generation == 0 and not s.incidents for s in steps)
    poisoned = replay(_summed_rows(weight, poison_at=300), "summed")
    assert _findings(poisoned, "grad_norm_high")[:1] == [300]


def _adafactor_rows(lr: float, steps: int) -> list[dict[str, float]]:
    """A TinyGPT trained with PyTorch's Adafactor (relative step sizes: each update is ``lr`` times
    the root mean square of the weights it moves, at most), a report every step."""
    torch.manual_seed(0)
    model = TinyGPT(seq_len=32, d_model=32, n_layers=1, n_heads=2)
    opt = torch.optim.Adafactor(model.parameters(), lr=lr)
    agent = ta.attach(model, opt, job="adafactor", run="r",
                      config=ta.AgentConfig(metrics_port=None, report_every=1, skip_spikes=True))
    return train(agent, opt, lambda k: next_byte_loss(model, *CORPUS.batch(k, 0)), steps)


def test_adafactors_relative_step_draws_no_update_ratio_alert() -> None:
    # At its default lr 1e-2 Adafactor clips its update to 1e-2 of the weights' size: the update
    # ratio reads 1e-2 to within float32 rounding, above it in 3 reports in a row at step 85.
    rows = _adafactor_rows(1e-2, 120)
    ratios = [r["trainguard_update_ratio"] for r in rows]
    assert max(ratios[50:]) == pytest.approx(0.01, rel=1e-4) and sum(x > 0.01 for x in ratios[50:]) >= 10
    assert _findings(replay(rows, "adafactor"), "update_ratio_high") == []


def test_adafactor_at_5_times_its_relative_step_draws_the_update_ratio_alert() -> None:
    rows = _adafactor_rows(5e-2, 8)
    assert min(r["trainguard_update_ratio"] for r in rows) > 0.04  # above the first steps' limit
    assert _findings(replay(rows, "adafactor"), "update_ratio_high")[:1] == [3]
