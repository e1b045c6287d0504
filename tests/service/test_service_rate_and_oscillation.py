"""The rate and oscillation rule kinds (``service/rate_and_oscillation.py``) and the default rules built on them, table-driven:
each with a case that trips it and a healthy one that does not. Expected values by hand."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

import trainer_agent as ta
from trainguard.demo.model import ByteCorpus, TinyGPT, next_byte_loss, stdlib_source_bytes
from trainguard.protocol.wire import Report
from trainguard.service.engine import simulate
from trainguard.service.rules import default_rules_text, load_rules
from trainguard.service.rate_and_oscillation import periodogram_peak
from tests.service.conftest import make_report

DEFAULTS = load_rules(default_rules_text())
CORPUS = ByteCorpus(stdlib_source_bytes(1 << 18), seq_len=32, batch_size=8)


def fired(steps) -> list[list[str]]:
    return [[f.finding.rule.name for f in s.fired] for s in steps]


def reports(rows: list[dict[str, float]], every: int = 10):
    return [make_report(i * every, float(i), row) for i, row in enumerate(rows)]


@pytest.mark.parametrize("skipped_per_report, expect", [
    ([0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0], False),   # 1 skip in 110 steps: the scaler finding its scale
    ([0, 0, 1, 2, 2, 3, 5, 6, 7, 9, 10, 10], True),  # 55 of 110 steps skipped: 0.5 > 0.05
])
def test_amp_skip_rate(skipped_per_report, expect):
    total = np.cumsum(skipped_per_report).tolist()
    rows = [{"trainguard_step": float(10 * i), "trainguard_amp_skipped_steps_total": float(t)} for i, t in enumerate(total)]
    steps = simulate(DEFAULTS.for_job("j"), reports(rows), world_size=1)
    names = [n for f in fired(steps) for n in f]
    assert ("amp_skip_rate" in names) is expect
    if expect:
        first = next(s for s in steps if s.fired)
        rate = first.fired[0].finding.values["rate"]
        i = first.index
        lo = max(0, i - 10)
        assert rate == pytest.approx((total[i] - total[lo]) / (10.0 * (i - lo)))


def _float16_run(every: int, weight: float, bad_steps: range = range(0)) -> tuple[list[dict[str, float]], list[int]]:
    """A TinyGPT trained 300 steps with AdamW at 2e-3 under float16 autocast with a GradScaler at
    its initial scale 2**16 and growth_interval 50, its loss times ``weight`` (the scaled gradients
    overflow at first: the scaler's search for its scale), a report every ``every`` steps; on the
    steps (1-based) of ``bad_steps`` the final norm's weight gets an infinite gradient (a layer
    that overflows). The reports, and the steps on which the scaler skipped the update."""
    torch.manual_seed(0)
    model = TinyGPT(seq_len=32, d_model=32, n_layers=1, n_heads=2)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cpu", growth_interval=50)
    agent = ta.attach(model, opt, job="amp", run="r", scaler=scaler,
                      config=ta.AgentConfig(metrics_port=None, report_every=every))
    rows, skipped, step = [], [], [0]
    model.ln_f.weight.register_hook(lambda g: g * math.inf if step[0] in bad_steps else g)
    for k in range(300):
        step[0] = k + 1
        with torch.autocast("cpu", dtype=torch.float16):
            loss = next_byte_loss(model, *CORPUS.batch(k, 0)) * weight
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        agent.end_step(loss.detach())
        skipped += [k + 1] if scaler.get_scale() < scale else []
        rows += [agent.latest()] if (k + 1) % every == 0 else []
    agent.close(1.0)
    return rows, skipped


def _amp_skip_rate_findings(rows: list[dict[str, float]], every: int) -> list[Any]:
    reps = [Report(job="amp", step_first=int(v["trainguard_step"]) - every + 1, step_last=int(v["trainguard_step"]),
                   time=float(i), values={k: x for k, x in v.items() if "{" not in k}) for i, v in enumerate(rows)]
    return [(s.step_last, f.finding) for s in simulate(DEFAULTS.for_job("amp"), reps, world_size=1)
            for f in s.fired if f.finding.rule.name == "amp_skip_rate"]


@pytest.mark.parametrize("every, weight, startup", [(1, 64.0, 6), (10, 4096.0, 11)])
def test_a_healthy_grad_scalers_back_offs_draw_no_amp_skip_rate(every, weight, startup):
    """The scaler's search for its scale skips the first steps, then it backs off once now and
    then after doubling its scale (every 50 steps without an overflow here; 2,000 by default).
    The rule measured 10 reports: with a report every step, the second step's report read as
    100 % skipped and each later back-off as 10 %; with a report every 10 steps, a search that
    ran past the first report (11 skips in 20 steps) read as 55 %."""
    rows, skipped = _float16_run(every, weight)
    assert skipped[:startup] == list(range(1, startup + 1)) and len(skipped) >= startup + 2
    assert rows[-1]["trainguard_amp_skipped_steps_total"] == len(skipped)
    assert _amp_skip_rate_findings(rows, every) == []


@pytest.mark.parametrize("every", [1, 10])
def test_a_sustained_amp_skip_rate_is_found(every):
    # from step 150 a gradient overflows every third step: a third of the steps skipped
    rows, skipped = _float16_run(every, 64.0, bad_steps=range(150, 301, 3))
    assert set(range(150, 301, 3)) <= set(skipped)
    found = _amp_skip_rate_findings(rows, every)
    assert found and 150 < found[0][0] <= 200
    step, finding = found[0]
    back = step - int(finding.values["steps"])
    assert finding.values["steps"] >= 100
    assert finding.values["rate"] == pytest.approx(
        (sum(back < s <= step for s in skipped)) / finding.values["steps"])


@pytest.mark.parametrize("scales, expect", [
    ([65536.0, 32768.0, 65536.0, 65536.0], [[], [], [], []]),
    ([1024.0, 16.0, 2.0, 1.0], [[], [], [], ["amp_loss_scale_floor"]]),
])
def test_amp_loss_scale_floor(scales, expect):
    steps = simulate(DEFAULTS.for_job("j"), reports([{"trainguard_loss_scale": s} for s in scales]), world_size=1)
    assert fired(steps) == expect


def _loss(kind: str, n: int = 64) -> list[float]:
    rng = np.random.default_rng(3)
    t = np.arange(n)
    trend = 3.0 - 0.01 * t
    if kind == "periodic":
        return (trend + 0.15 * np.sin(2 * np.pi * t / 8) + rng.normal(0, 0.01, n)).tolist()
    if kind == "tiny_periodic":  # a 0.1 % ripple: below the amplitude floor
        return (trend + 0.003 * np.sin(2 * np.pi * t / 8)).tolist()
    return (trend + rng.normal(0, 0.05, n)).tolist()  # healthy: falling with noise


@pytest.mark.parametrize("kind, expect", [("periodic", True), ("healthy", False), ("tiny_periodic", False)])
def test_loss_oscillation(kind, expect):
    steps = simulate(DEFAULTS.for_job("j"), reports([{"trainguard_loss": v} for v in _loss(kind)]), world_size=1)
    names = [n for f in fired(steps) for n in f]
    assert ("loss_oscillation" in names) is expect
    if expect:
        values = steps[-1].fired[0].finding.values
        assert values["period_reports"] == pytest.approx(8.0)
        assert values["autocorrelation"] > 0.8


def test_a_one_off_bump_in_the_loss_is_not_an_oscillation():
    # the loss of a run through a 20-report burst of corrupted batches (as a real run reported it):
    # most of the window's variance sits at a period of 32 reports, but it never comes back a
    # period later (autocorrelation ~0), so the loss does not oscillate; a swing of the same size
    # and period that repeats does
    rng = np.random.default_rng(5)
    t = np.arange(64)
    bump = 3.0 + rng.normal(0, 0.15, 64)
    bump[36:56] = 5.6 + rng.normal(0, 0.02, 20)
    bump[56:] = 4.4 + rng.normal(0, 0.07, 8)
    share, period, acf = periodogram_peak(bump)
    assert share >= 0.5 and period == 32.0 and abs(acf) < 0.2  # what the rule used to fire on
    steps = simulate(DEFAULTS.for_job("j"), reports([{"trainguard_loss": float(v)} for v in bump]), world_size=1)
    assert "loss_oscillation" not in [n for f in fired(steps) for n in f]
    swing = 3.0 + 1.2 * np.sin(2 * np.pi * t / 32) + rng.normal(0, 0.15, 64)
    steps = simulate(DEFAULTS.for_job("j"), reports([{"trainguard_loss": float(v)} for v in swing]), world_size=1)
    assert "loss_oscillation" in [n for f in fired(steps) for n in f]


def test_periodogram_peak_of_a_pure_sine_and_of_a_line():
    t = np.arange(64, dtype=np.float64)
    share, period, acf = periodogram_peak(5.0 + np.sin(2 * np.pi * t / 16))
    assert share > 0.95 and period == 16.0 and acf == pytest.approx(48 / 64, abs=0.05)  # the line fit leaks a little
    assert periodogram_peak(2.0 - 0.1 * t)[1] == math.inf  # nothing left around the trend


@pytest.mark.parametrize("metric, values, rule", [
    ("trainguard_grad_max_abs", [10.0, 1001.0], "grad_value_high"),
    ("trainguard_update_size_ratio", [1.0, 5.0, 5.0, 5.0], "update_size_high"),
    ("trainguard_update_size_ratio", [5e-4] * 10, "update_size_low"),
])
def test_triage_thresholds(metric, values, rule):
    steps = simulate(DEFAULTS.for_job("j"), reports([{metric: v} for v in values]), world_size=1)
    assert fired(steps)[-1] == [rule] and all(f == [] for f in fired(steps)[:-1])
    healthy = simulate(DEFAULTS.for_job("j"), reports([{metric: 1.0 if "ratio" in metric else 10.0} for _ in values]), world_size=1)
    assert all(f == [] for f in fired(healthy))


def test_detrending_removes_the_same_line_as_a_least_squares_fit():
    from trainguard.service.rate_and_oscillation import _detrended

    rng = np.random.default_rng(0)
    for n in (2, 3, 17, 64):
        values = 5.0 + 0.7 * np.arange(n) + 3.0 * rng.normal(size=n)
        t = np.arange(n, dtype=np.float64)
        reference = values - np.polyval(np.polyfit(t, values, 1), t)
        assert np.allclose(_detrended(values), reference, rtol=0, atol=1e-12)
