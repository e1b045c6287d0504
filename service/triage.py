"""Evaluation of the triage rule kinds (pure functions of a :class:`~service.window.RuleWindow`):
``rate`` (a counter's increase per step over a window of reports, e.g. the share of steps the
mixed-precision loss scaler skipped) and ``oscillation`` (a periodic swing of a metric: the
stability guide's symptom table, row 2)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from trainguard.service.rules import OscillationRule, RateRule
from trainguard.service.window import RuleWindow

__all__ = ["rate", "oscillation", "periodogram_peak"]


def rate(rule: RateRule, w: RuleWindow, now: float, finding: Any) -> Any:
    if w.latest(rule.metric) is None or w.latest(rule.per) is None:
        return finding(rule, None)
    counts = w.series(rule.metric, rule.window + 1)
    steps = w.series(rule.per, rule.window + 1)
    n = min(len(counts), len(steps))
    if n < 2:
        return finding(rule, None)
    counts, steps = counts[-n:], steps[-n:]
    d_steps = float(steps[-1] - steps[0])
    d_count = float(counts[-1] - counts[0])
    if not (d_steps > 0 and math.isfinite(d_count)):
        return finding(rule, None)
    value = d_count / d_steps
    if not value > rule.value:
        return finding(rule, False)
    return finding(
        rule, True,
        f"{rule.metric} rose by {d_count:g} over {d_steps:g} {rule.per} ({value:.3g} per step; limit {rule.value:g})",
        {"metric": rule.metric, "per": rule.per, "rate": value, "limit": rule.value, "increase": d_count,
         "steps": d_steps, "reports": n},
    )


def periodogram_peak(values: np.ndarray) -> tuple[float, float, float]:
    """(share of the detrended variance in the strongest frequency and its two neighbours,
    period in reports, lag-``period`` autocorrelation) of ``values`` after removing the
    least-squares line."""
    n = len(values)
    t = np.arange(n, dtype=np.float64)
    slope, intercept = np.polyfit(t, values, 1)
    x = values - (slope * t + intercept)
    if not np.abs(x).max() > 1e-12 * max(float(np.abs(values).max()), 1e-300):
        return 0.0, math.inf, 0.0  # nothing around the line but rounding
    power = np.abs(np.fft.rfft(x)) ** 2
    power[0] = 0.0
    total = float(power.sum())
    if total <= 0:
        return 0.0, math.inf, 0.0
    k = int(np.argmax(power))
    share = float(power[max(k - 1, 1):k + 2].sum()) / total
    period = n / k
    lag = int(round(period))
    acf = float(np.dot(x[:-lag], x[lag:]) / np.dot(x, x)) if 0 < lag < n else 0.0
    return share, period, acf


def oscillation(rule: OscillationRule, w: RuleWindow, now: float, finding: Any) -> Any:
    if w.latest(rule.metric) is None:
        return finding(rule, None)
    vals = w.series(rule.metric, rule.window)
    if len(vals) < rule.window or not np.isfinite(vals).all():
        return finding(rule, None)
    share, period, acf = periodogram_peak(vals)
    mean = abs(float(vals.mean()))
    t = np.arange(len(vals), dtype=np.float64)
    resid = vals - np.polyval(np.polyfit(t, vals, 1), t)
    amplitude = float(np.sqrt(2.0) * resid.std())
    rel_amplitude = amplitude / mean if mean > 0 else math.inf
    values = {"metric": rule.metric, "power_share": share, "period_reports": period, "autocorrelation": acf,
              "amplitude": amplitude, "rel_amplitude": rel_amplitude, "window": len(vals)}
    periodic = share >= rule.min_power and rule.min_period <= period <= len(vals) / 2
    if not (periodic and rel_amplitude >= rule.min_rel_amplitude):
        return finding(rule, False, "", values)
    return finding(
        rule, True,
        f"{rule.metric} oscillates with a period of {period:.3g} reports ({share:.0%} of its variance around the "
        f"trend; amplitude {rel_amplitude:.2%} of its mean)",
        values,
    )
